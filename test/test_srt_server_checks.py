"""srt/server_checks.py on plain objects (no SGLang import): CUDA-graph phases int2 can run with."""

import types

import pytest

from sglang_oscar.srt.options import OscarOptionError
from sglang_oscar.srt.server_checks import adjust_cuda_graphs, check_server_args, select_backend


class _Cfg(dict):
    """The shape of SGLang 0.5.17's CudaGraphConfig that the check reads: cfg["decode"].backend."""


def _sa(kv="int2", decode="full", prefill="breakable", **kw):
    cfg = _Cfg(decode=types.SimpleNamespace(backend=decode), prefill=types.SimpleNamespace(backend=prefill))
    base = dict(kv_cache_dtype=kv, cuda_graph_config=cfg, max_running_requests=8, attention_backend="oscar_int2")
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_prefill_graphs_turned_off_for_int2_and_said(monkeypatch):
    sa = _sa()
    msg = adjust_cuda_graphs(sa)
    assert sa.cuda_graph_config["prefill"].backend == "disabled" and "breakable" in msg
    assert sa.cuda_graph_config["decode"].backend == "full"
    assert adjust_cuda_graphs(sa) is None  # nothing left to change


@pytest.mark.parametrize("decode", ["full", "disabled"])
def test_decode_full_or_off_accepted(decode, monkeypatch):
    sa = _sa(decode=decode, prefill="disabled")
    assert adjust_cuda_graphs(sa) is None and sa.cuda_graph_config["decode"].backend == decode


@pytest.mark.parametrize("decode", ["breakable", "tc_piecewise"])
def test_other_decode_graph_backends_refused(decode, monkeypatch):
    with pytest.raises(OscarOptionError, match="--cuda-graph-backend-decode full"):
        adjust_cuda_graphs(_sa(decode=decode))


def test_other_kv_dtypes_untouched():
    sa = _sa(kv="auto", decode="breakable")
    assert adjust_cuda_graphs(sa) is None and sa.cuda_graph_config["prefill"].backend == "breakable"


def test_plain_int2_needs_neither_r_nor_a_backend(monkeypatch):
    """`--kv-cache-dtype int2` alone: R is sized from the KV budget later, and the backend is selected (before
    SGLang's default would be, at the start of ServerArgs.__post_init__)."""
    sa = _sa(max_running_requests=None, attention_backend=None)
    check_server_args(sa)
    assert select_backend(sa) == "--attention-backend oscar_int2 selected for --kv-cache-dtype int2"
    assert sa.attention_backend == "oscar_int2"
    check_server_args(sa)
    assert select_backend(sa) is None  # already chosen: nothing to do
    check_server_args(_sa(max_running_requests=8))  # an explicit R keeps working


def test_another_backend_is_refused_and_never_replaced(monkeypatch):
    for given in (dict(attention_backend="flashinfer"), dict(attention_backend=None, decode_attention_backend="fa3"),
                  dict(attention_backend="oscar_int2", prefill_attention_backend="triton")):
        sa = _sa(**given)
        assert select_backend(sa) is None and sa.attention_backend == given["attention_backend"]
        with pytest.raises(OscarOptionError, match="read only by --attention-backend oscar_int2 .*leave the attention "
                                                   "backend out"):
            check_server_args(sa)
    stock = _sa(kv="auto", attention_backend=None)
    assert select_backend(stock) is None and stock.attention_backend is None  # stock servers untouched


def test_pipeline_stages_need_an_explicit_r(monkeypatch):
    with pytest.raises(OscarOptionError, match="--pp-size > 1 needs --max-running-requests"):
        check_server_args(_sa(max_running_requests=None, pp_size=2))
    check_server_args(_sa(max_running_requests=8, pp_size=2))


@pytest.mark.parametrize("page", [1, 2, 16, 64, 128, 256])
def test_page_sizes_the_int2_pool_stores(page, monkeypatch):
    """Accepted: no error, nothing returned, and the server args left as they were (page_size included); the same
    args with a page size of 3·P (never a power of two) are refused."""
    for given in (page, None):  # None: before SGLang's default pass (page 1)
        sa = _sa(page_size=given)
        before = dict(vars(sa))
        assert check_server_args(sa) is None
        assert vars(sa) == before and sa.page_size == given
    with pytest.raises(OscarOptionError, match=f"supports --page-size .*\\(got {3 * page}\\)"):
        check_server_args(_sa(page_size=3 * page))


@pytest.mark.parametrize("page", [3, 48, 512])
def test_page_sizes_the_kernels_do_not_support(page, monkeypatch):
    with pytest.raises(OscarOptionError, match=f"supports --page-size 1, 2, 4, .*256 \\(got {page}\\)"):
        check_server_args(_sa(page_size=page))


def test_kv_canary_only_on_the_flat_pool(monkeypatch):
    """SGLang's kv canary counts k_buffer.shape[0] as slots and hashes k_buffer rows as tokens: pages at P > 1."""
    check_server_args(_sa(page_size=1, kv_canary="log"))
    check_server_args(_sa(page_size=64, kv_canary="none"))
    with pytest.raises(OscarOptionError, match="--page-size 64 does not support --kv-canary log"):
        check_server_args(_sa(page_size=64, kv_canary="log"))


@pytest.mark.parametrize("flag,what", [("enable_lmcache", "--enable-lmcache"), ("enable_flexkv", "--enable-flexkv")])
def test_kv_offload_connectors_refused(flag, what, monkeypatch):
    """LMCache / FlexKV copy k_buffer / v_buffer rows only (no params, no windows, and pages at P > 1)."""
    with pytest.raises(OscarOptionError, match=f"does not support {what}"):
        check_server_args(_sa(**{flag: True}))
