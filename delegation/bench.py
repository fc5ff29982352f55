"""``python -m delegation.bench``: the benchmark's entry point; the benchmark itself
lives in ``tools/bench.py`` of a checkout, outside the installed package."""

if __name__ == "__main__":
    import sys

    from delegation._checkout import tools_on_path

    tools_on_path("the benchmark")
    from tools.bench import main

    sys.exit(main())
