"""`python -m sglang_oscar.launch_server ARGS`: SGLang's own launch_server with our plugin selected.

Every SGLang flag is accepted unchanged (the arguments go to SGLang's parser, which our hooks
extend with "int2" and --kv-cache-quant-group-size). What this adds over
`python -m sglang.launch_server`: SGLANG_PLUGINS names sglang_oscar, so our hooks load in the main
and scheduler processes (children inherit the environment) and unrelated installed plugins
(0.5.17 ships two, smg-servicer and smg-zmq) do not, unless the caller already chose a list.
"""

from __future__ import annotations

import os
import runpy
import sys

PLUGIN_NAME = "sglang_oscar"


def plugin_env(env=None) -> dict:
    """The environment changes the launcher makes (pure, for tests)."""
    env = os.environ if env is None else env
    chosen = [p.strip() for p in env.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    if PLUGIN_NAME not in chosen:
        chosen.append(PLUGIN_NAME)
    return {"SGLANG_PLUGINS": ",".join(chosen)}


def main(argv=None) -> None:
    os.environ.update(plugin_env())
    sys.argv = ["sglang.launch_server"] + list(sys.argv[1:] if argv is None else argv)
    # Run SGLang's module as __main__ (load_plugins, prepare_server_args, run_server, cleanup):
    # no copy of its startup logic to drift from the pinned version.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
