"""`python -m sglang_oscar.launch_server ...` = SGLang's launch_server with the int2 plugin (srt/launch.py)."""

import importlib.util
import sys

SERVE_HINT = ("install the serving extras with `pip install .[serve]` (sglang==0.5.17, torch==2.11.0; "
              "docs/serving.md)")


def require_sglang(prog: str) -> None:
    """Exit with one line (status 2) where SGLang is not installed, as in the CPU development venv, instead of the
    ModuleNotFoundError traceback of the first sglang import."""
    if importlib.util.find_spec("sglang") is None:
        print(f"error: {prog} needs SGLang, which is not installed in this Python ({sys.executable}); {SERVE_HINT}",
              file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    require_sglang("python -m sglang_oscar.launch_server")
    from sglang_oscar.srt.launch import main

    main()
