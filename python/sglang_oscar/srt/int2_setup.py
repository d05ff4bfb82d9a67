"""Everything one scheduler process decides once for the int2 pool: options, rotation shard, sizes.

The capacity hook (pool sizing) and the pool-build hook run at different times in the same
process and must agree on the group sizes, R and the window rows; both ask `setup_for_kvc`, which
computes it once per model config and caches it. Loading and validating the rotation bundle
happens here, so a bundle that does not match the model fails before any KV memory is taken; and
before that, in the launcher's process, check_before_load validates it for every rank before any
process is spawned or any weight is loaded (the ServerArgs.from_cli_args hook).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from ..config import CacheLayout
from . import capacity, options
from .options import OscarOptionError, OscarServeConfig
from .startup_checks import ModelInfo, StartupPlan, load_rotation, plan_rank

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Int2Setup:
    cfg: OscarServeConfig
    plan: StartupPlan
    shape: capacity.ModelShape  # num_layers = this rank's layers; kv_heads total (+ tp_size)
    layout: CacheLayout
    # R per attention-DP worker: the ring is reserved for R (+1 padding) requests. None until the pool sizing
    # hook knows the budget when --max-running-requests is not given (then capacity.auto_max_running_requests).
    max_running_requests: Optional[int]
    num_sink_rows: Optional[int]  # None: capacity.default_sink_rows(R), set with R
    requests_from_budget: bool = False  # R was sized from the budget (no --max-running-requests)
    available_bytes: Optional[int] = None  # the KV budget it was sized for
    page_size: int = 1
    cache_key: tuple = dataclasses.field(default=(), compare=False)

    @property
    def cell_bytes(self) -> int:
        return capacity.int2_cell_bytes(self.shape, self.layout)

    def for_budget(self, available_bytes: int, page_size: int) -> "Int2Setup":
        """This setup with R fixed for a KV budget: the given R, else the one capacity.py sizes from the budget."""
        r, auto = self.max_running_requests, self.requests_from_budget
        if r is None or auto:
            r, auto = capacity.auto_max_running_requests(available_bytes, self.shape, self.layout,
                                                         window_dtype=self.cfg.window_dtype), True
        rows = self.num_sink_rows
        if rows is None or auto:
            rows = capacity.default_sink_rows(r, self.cfg.sink)
        return dataclasses.replace(self, max_running_requests=r, num_sink_rows=rows, requests_from_budget=auto,
                                   available_bytes=available_bytes, page_size=page_size)

    def sized_requests(self) -> int:
        """R; an error if the pool sizing hook has not fixed it yet."""
        if self.max_running_requests is None:
            raise RuntimeError("sglang_oscar: the int2 pool is used before the pool sizing hook fixed its request "
                               "count; this SGLang version sizes KV pools in another order")
        return self.max_running_requests

    @property
    def fixed(self) -> capacity.FixedBytes:
        return capacity.fixed_bytes(self.shape, self.layout, self.sized_requests(), num_sink_rows=self.num_sink_rows,
                                    window_dtype=self.cfg.window_dtype)

    def max_total_num_tokens(self, available_bytes: int, page_size: int) -> int:
        return capacity.max_total_num_tokens(available_bytes, self.shape, self.layout, self.sized_requests(),
                                             page_size=page_size, num_sink_rows=self.num_sink_rows,
                                             window_dtype=self.cfg.window_dtype)

    def report(self, available_bytes: int, page_size: int) -> capacity.CapacityReport:
        return capacity.capacity_report(available_bytes, self.shape, self.layout, self.sized_requests(),
                                        page_size=page_size, num_sink_rows=self.num_sink_rows,
                                        window_dtype=self.cfg.window_dtype)

    def startup_line(self, tokens: int, max_running_requests: int, context_len: Optional[int]) -> str:
        """capacity.capacity_line for the final token count and running-request limit SGLang settled on."""
        return capacity.capacity_line(tokens, self.report(self.available_bytes, self.page_size), max_running_requests,
                                      context_len, from_budget=self.requests_from_budget)


def model_info(model_config, tp_size: int) -> ModelInfo:
    """ModelInfo from SGLang's ModelConfig (text config for multimodal wrappers)."""
    hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    info = ModelInfo.from_hf_config(hf, tp_size)
    arch = (getattr(model_config.hf_config, "architectures", None) or [info.architecture])[0]
    info = dataclasses.replace(info, architecture=arch)
    # SGLang's own head_dim wins over the HF field guess; they must agree or our kernels get the wrong D.
    sgl_head_dim = getattr(model_config, "head_dim", None)
    if sgl_head_dim is not None and int(sgl_head_dim) != info.head_dim:
        info = dataclasses.replace(info, head_dim=int(sgl_head_dim))
    v_head_dim = getattr(model_config, "v_head_dim", None)
    if v_head_dim is not None and int(v_head_dim) != info.head_dim:
        raise OscarOptionError(f"--kv-cache-dtype int2 needs equal K and V head dims; {arch} has "
                               f"head_dim {info.head_dim} and v_head_dim {v_head_dim}")
    return info


def attention_tp_size(sa) -> int:
    """Ranks the attention heads are split over (SGLang's attn_tp_size): tp_size, divided by dp_size under DP
    attention."""
    tp = int(getattr(sa, "tp_size", 1) or 1)
    dp = int(getattr(sa, "dp_size", 1) or 1) if getattr(sa, "enable_dp_attention", False) else 1
    return max(tp // max(dp, 1), 1)


def check_before_load(sa, cfg: OscarServeConfig, model_config=None) -> tuple:
    """(ModelInfo, rank 0's StartupPlan) of the model a ServerArgs names, with the rotation source loaded and checked
    against the model for every attention TP rank: what the schedulers would refuse after loading the weights, refused
    before anything is spawned. model_config: SGLang's ModelConfig (default: the one ServerArgs resolved)."""
    if model_config is None:
        model_config = getattr(sa, "model_config", None)
    if model_config is None:
        from sglang.srt.configs.model_config import ModelConfig

        model_config = ModelConfig.from_server_args(sa)
    if getattr(model_config, "is_hybrid_swa", False) or "MLA" in str(getattr(model_config, "attention_arch", "")):
        raise OscarOptionError("--kv-cache-dtype int2 supports dense MHA/GQA models only (not MLA or hybrid "
                               "sliding-window models)")
    tp = attention_tp_size(sa)
    info = model_info(model_config, tp)
    from .startup_checks import check_model

    check_model(info)
    bundle = load_rotation(cfg, info, cfg.group_size)
    plans = [plan_rank(cfg, info, rank, bundle=bundle) for rank in range(tp)]
    return info, plans[0]


def build_setup(cfg: OscarServeConfig, info: ModelInfo, *, tp_rank: int, num_layers: int,
                max_running_requests: Optional[int], num_sink_rows: Optional[int] = None) -> Int2Setup:
    """Pure: the options + model + rank -> what to allocate (no SGLang objects). max_running_requests None: sized
    from the KV budget later (Int2Setup.for_budget)."""
    if max_running_requests is not None and max_running_requests < 1:
        raise OscarOptionError(f"max running requests per worker is {max_running_requests}; int2 needs >= 1 "
                               "(raise --max-running-requests)")
    plan = plan_rank(cfg, info, tp_rank)  # loads + validates the bundle against the model
    shape = capacity.ModelShape(num_layers, info.kv_heads, info.head_dim, info.tp_size)
    if plan.k4_heads_max and num_layers != plan.bundle.num_layers:
        raise OscarOptionError(f"this rank holds {num_layers} of the model's {plan.bundle.num_layers} layers "
                               "(pipeline parallelism) and the rotation bundle stores INT4 keys on some heads: the "
                               "pool size per stage is not worked out for that; serve without pipeline parallelism")
    layout = capacity.layout_for(cfg.sink, cfg.recent, plan.k_group, plan.v_group, plan.k4_heads_max)
    if num_sink_rows is None and max_running_requests is not None:
        num_sink_rows = capacity.default_sink_rows(max_running_requests, cfg.sink)
    return Int2Setup(cfg, plan, shape, layout, max_running_requests, num_sink_rows)


_CACHE: dict = {}


def setup_for_kvc(kvc, num_layers: Optional[int] = None) -> Int2Setup:
    """The (cached) setup of the model a KVCacheConfigurator sizes/builds pools for; once the pool sizing hook
    has fixed R for the budget (size_for_budget), that one."""
    from .server_checks import adjust_cuda_graphs, check_server_args

    sa = kvc.server_args
    check_server_args(sa)  # again here: the Engine API never runs the from_cli_args hook
    from .hooks import ensure_rotations

    ensure_rotations(sa)
    msg = adjust_cuda_graphs(sa)
    if msg:
        logging.getLogger(__name__).info("sglang_oscar: %s", msg)
    layers = kvc.layer_info.num_effective_layers if num_layers is None else num_layers
    dp = max(int(getattr(kvc.ps, "attn_dp_size", 1) or 1), 1)
    tp_size = int(getattr(kvc.ps, "attn_tp_size", 1) or 1)
    tp_rank = int(getattr(kvc.ps, "attn_tp_rank", 0) or 0)
    key = (id(kvc.model_config), layers, tp_rank, tp_size, dp, sa.max_running_requests)
    if key not in _CACHE:
        info = model_info(kvc.model_config, tp_size)
        sgl_heads = kvc.model_config.get_num_kv_heads(tp_size)
        given = sa.max_running_requests
        s = build_setup(options.current(), info, tp_rank=tp_rank, num_layers=layers,
                        max_running_requests=None if given is None else given // dp)
        if s.shape.kv_heads_per_rank != sgl_heads:
            raise OscarOptionError(f"SGLang puts {sgl_heads} KV heads on each rank, our sharding "
                                   f"{s.shape.kv_heads_per_rank}; this SGLang version shards differently")
        _CACHE[key] = dataclasses.replace(s, cache_key=key)
    return _CACHE[key]


def size_for_budget(s: Int2Setup, available_bytes: int, page_size: int) -> Int2Setup:
    """s with R fixed for the KV budget (Int2Setup.for_budget), kept as the setup of its model for the hooks that
    run after the pool sizing (the request limit, the pool build)."""
    sized = s.for_budget(available_bytes, page_size)
    if s.cache_key:
        _CACHE[s.cache_key] = sized
    logger.info("%s; groups K=%d V=%d, R=%d requests/worker%s, %d sink rows", sized.cfg.summary(), sized.plan.k_group,
                sized.plan.v_group, sized.max_running_requests,
                " (sized from the KV budget)" if sized.requests_from_budget else "", sized.num_sink_rows)
    return sized
