"""srt/server_checks.py on plain objects (no SGLang import): CUDA-graph phases int2 can run with."""

import types

import pytest

from sglang_oscar.srt.options import OscarOptionError
from sglang_oscar.srt.server_checks import adjust_cuda_graphs, check_server_args


class _Cfg(dict):
    """The shape of SGLang 0.5.17's CudaGraphConfig that the check reads: cfg["decode"].backend."""


def _sa(kv="int2", decode="full", prefill="breakable", **kw):
    cfg = _Cfg(decode=types.SimpleNamespace(backend=decode), prefill=types.SimpleNamespace(backend=prefill))
    base = dict(kv_cache_dtype=kv, cuda_graph_config=cfg, max_running_requests=8, attention_backend="oscar_int2")
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_prefill_graphs_turned_off_for_int2_and_said(monkeypatch):
    monkeypatch.delenv("SGLANG_OSCAR_POOL_ONLY", raising=False)
    sa = _sa()
    msg = adjust_cuda_graphs(sa)
    assert sa.cuda_graph_config["prefill"].backend == "disabled" and "breakable" in msg
    assert sa.cuda_graph_config["decode"].backend == "full"
    assert adjust_cuda_graphs(sa) is None  # nothing left to change


@pytest.mark.parametrize("decode", ["full", "disabled"])
def test_decode_full_or_off_accepted(decode, monkeypatch):
    monkeypatch.delenv("SGLANG_OSCAR_POOL_ONLY", raising=False)
    sa = _sa(decode=decode, prefill="disabled")
    assert adjust_cuda_graphs(sa) is None and sa.cuda_graph_config["decode"].backend == decode


@pytest.mark.parametrize("decode", ["breakable", "tc_piecewise"])
def test_other_decode_graph_backends_refused(decode, monkeypatch):
    monkeypatch.delenv("SGLANG_OSCAR_POOL_ONLY", raising=False)
    with pytest.raises(OscarOptionError, match="--cuda-graph-backend-decode full"):
        adjust_cuda_graphs(_sa(decode=decode))


def test_other_kv_dtypes_untouched():
    sa = _sa(kv="auto", decode="breakable")
    assert adjust_cuda_graphs(sa) is None and sa.cuda_graph_config["prefill"].backend == "breakable"


def test_int2_needs_pinned_requests_and_our_backend(monkeypatch):
    monkeypatch.delenv("SGLANG_OSCAR_POOL_ONLY", raising=False)
    with pytest.raises(OscarOptionError, match="--max-running-requests"):
        check_server_args(_sa(max_running_requests=None))
    with pytest.raises(OscarOptionError, match="oscar_int2"):
        check_server_args(_sa(attention_backend="flashinfer"))
    check_server_args(_sa())
