"""``python -m delegation.soak``: the soak's entry point; it lives in
:mod:`delegation.tools.soak`, outside the library's import graph."""

if __name__ == "__main__":
    import sys

    from delegation.tools.soak import main

    sys.exit(main())
