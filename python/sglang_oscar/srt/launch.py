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


def run_sglang_module(module: str, argv=None, *, load_plugins: bool = False) -> None:
    """Run one of SGLang's command-line modules as __main__ with our plugin selected.

    load_plugins: call SGLang's load_plugins() first, for entry points that never do
    (sglang.benchmark.one_batch builds a ModelRunner in-process at TP 1); launch_server and the
    scheduler processes call it themselves."""
    os.environ.update(plugin_env())
    sys.argv = [module] + list(sys.argv[1:] if argv is None else argv)
    if load_plugins:
        from sglang.srt.plugins import load_plugins as _load

        _load()
    # SGLang's own module as __main__: no copy of its startup logic to drift from the pinned version.
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(argv=None) -> None:
    run_sglang_module("sglang.launch_server", argv)
