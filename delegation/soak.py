"""``python -m delegation.soak``: the soak's entry point; the soak itself lives in
``tools/soak/`` of a checkout, outside the installed package."""

if __name__ == "__main__":
    import sys

    from delegation._checkout import tools_on_path

    tools_on_path("the soak")
    from tools.soak import main

    sys.exit(main())
