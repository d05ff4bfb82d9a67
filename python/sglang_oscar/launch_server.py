"""`python -m sglang_oscar.launch_server ...` = SGLang's launch_server with the int2 plugin (srt/launch.py)."""

from sglang_oscar.srt.launch import main

if __name__ == "__main__":
    main()
