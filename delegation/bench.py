"""``python -m delegation.bench``: the benchmark's entry point; it lives in
:mod:`delegation.tools.bench`, outside the library's import graph."""

if __name__ == "__main__":
    import sys

    from delegation.tools.bench import main

    sys.exit(main())
