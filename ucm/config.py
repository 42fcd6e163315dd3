"""The UCM YAML schema: typed, strict, with every default filled in.

The config comes either from a YAML file named by ``UCM_CONFIG_FILE`` in vLLM's ``kv_connector_extra_config``, or
inline: the same keys placed directly in ``kv_connector_extra_config``. Example (``examples/ucm_config_example.yaml``)::

    ucm_connectors:
      - ucm_connector_name: "UcmPipelineStore"
        ucm_connector_config:
          store_pipeline: "Cache|Posix"
          storage_backends: "/mnt/kv"        # one directory, or several joined by ':'
          cache_buffer_capacity_gb: 64
    enable_event_sync: true
    use_layerwise: false

Every problem (unknown key, wrong type, unsupported value, missing file) raises one :class:`UcmConfigError` that
names the key, the value and what is allowed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

CONFIG_FILE_KEY = "UCM_CONFIG_FILE"
DEFAULT_STORAGE_DIR = ".ucm_store"
GIB = 1 << 30
DEFAULT_TRACE_MAX_MB = 64.0

# Pipelines this version builds.
SUPPORTED_PIPELINES = (
    "Cache|Posix",
    "Posix",
    "Cache|Compress|Posix",
    "Compress|Posix",
    "Cache|Mooncake|Posix",
    "Mooncake|Posix",
    "Cache|Mooncake",
    "Mooncake",
    "Cache|Compress|Mooncake|Posix",
    "Compress|Mooncake|Posix",
)
# Where the Mooncake stage's client settings come from when the config has no ``mooncake`` section nor
# ``mooncake_config_path`` (the environment variable of the seeds' Mooncake guide).
MOONCAKE_CONFIG_ENV = "MOONCAKE_CONFIG_PATH"
# Mooncake's smallest segment a client can mount (0 = none).
MOONCAKE_MIN_SEGMENT = 16 << 20
_SIZE_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
# KVfold (Compress stage) settings; kept in step with ucm.store.compress (checked there too).
COMPRESS_MODES = ("lossless", "fixed_rate", "off")
FIXED_RATE_RATIOS = (16,)
COMPRESS_RATIO_OFF = 32
DATA_TYPES = {0: "bf16"}
_COMPRESS_DEFAULTS = {"compress_mode": "lossless", "compress_ratio": 32, "data_type": 0, "decompress_thread_num": 4}


class UcmConfigError(ValueError):
    """The UCM config is invalid. The message names the key, the bad value and the allowed values."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _parse_size(value: Any) -> Any:
    """Bytes from an int or a string such as ``"3355443200"``, ``"4GB"``, ``"512 MB"`` (powers of 1024, as
    Mooncake's own config reads them); anything else is left for the type check to refuse."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", value.upper())
        if match is None:
            raise ValueError(f"{value!r} is not a size; allowed: bytes as an integer, or a number with KB, MB, GB, TB")
        return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])
    return value


class MooncakeConfig(_Strict):
    """The ``Mooncake`` stage's client: the keys of Mooncake's ``mooncake.json`` (the seeds' Mooncake guide), given
    as ``mooncake:`` in ``ucm_connector_config``, or read from the file named by ``mooncake_config_path`` or the
    ``MOONCAKE_CONFIG_PATH`` environment variable. Sizes are bytes, or strings such as ``"4GB"``.

    The lease that keeps an object from eviction while it is read is the master's setting
    (``mooncake_master --default_kv_lease_ttl=<ms>``), not the client's.
    """

    master_server_address: str = Field(
        description="host:port of mooncake_master's RPC service (its --rpc_address / --rpc_port, or --port)."
    )
    metadata_server: str = Field(
        "P2PHANDSHAKE",
        description="Transfer engine metadata: 'P2PHANDSHAKE' (clients exchange it directly; no metadata server) "
        "or the URL of one (etcd://..., http://...).",
    )
    protocol: str = Field("tcp", description="Transfer protocol: 'tcp', or 'rdma' with device_name set.")
    device_name: str = Field("", description="RDMA devices for protocol 'rdma' (e.g. 'mlx5_0'); '' for tcp.")
    local_hostname: str | None = Field(
        None,
        description="Address other nodes reach this client at (its segment is read from there); null: "
        "VLLM_HOST_IP if set, else 127.0.0.1 (one node only).",
    )
    global_segment_size: int = Field(
        3355443200,
        description="Bytes of this instance's DRAM mounted into the pool (objects of every instance are placed "
        "there); 0 = none (the instance only uses others' segments), else at least 16 MiB. Mounted by the worker "
        "process; the scheduler's lookup client mounts none.",
    )
    local_buffer_size: int = Field(
        16 << 20,
        ge=0,
        description="Bytes of the client's transfer buffer (UCM moves blocks from its own buffers: little is used).",
    )

    @field_validator("global_segment_size", "local_buffer_size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return _parse_size(value)

    @field_validator("master_server_address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"master_server_address {value!r} is not host:port (e.g. '10.0.0.1:50088')")
        return value

    @field_validator("global_segment_size")
    @classmethod
    def _segment(cls, value: int) -> int:
        if value != 0 and value < MOONCAKE_MIN_SEGMENT:
            raise ValueError(
                f"global_segment_size {value} bytes is too small; allowed: 0 (no segment) or at least "
                f"{MOONCAKE_MIN_SEGMENT} (16 MiB)"
            )
        return value

    @property
    def hostname(self) -> str:
        """``local_hostname``, or ``VLLM_HOST_IP``, or 127.0.0.1."""
        return self.local_hostname or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


def _read_mooncake_json(path: str, source: str) -> Any:
    """The mapping in the Mooncake config file ``path`` (named by ``source``)."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as err:
        raise ValueError(f"cannot read the Mooncake config file {path!r} ({source}): {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"the Mooncake config file {path!r} ({source}) is not valid JSON: {err}") from None


class UcmPipelineStoreConfig(_Strict):
    """``ucm_connector_config`` of a ``UcmPipelineStore``: the store pipeline and its stages' settings."""

    store_pipeline: str = Field(
        "Cache|Posix",
        description="Stages top first, joined by '|': one of " + ", ".join(map(repr, SUPPORTED_PIPELINES)) + ".",
    )
    storage_backends: str = Field(
        DEFAULT_STORAGE_DIR,
        description="Posix stage: directory, or several joined by ':' (blocks spread by key).",
    )
    cache_buffer_capacity_gb: float = Field(
        4.0, gt=0, description="Cache stage: DRAM capacity in GiB (LRU; blocks in use are never evicted)."
    )
    cache_prefault_gb: float = Field(
        0.0,
        ge=0,
        description="Cache stage: GiB of DRAM slots allocated and written once at start, in a background thread, "
        "so that the first blocks cached after a start (a restart's storage hits) do not pay first-touch page "
        "faults; at most cache_buffer_capacity_gb. One request's blocks (max_model_len tokens) are prefaulted "
        "whatever this is, and kept ready (replaced in the background as they are taken); 0 = no more than those.",
    )
    io_direct: bool = Field(
        False,
        description="Posix stage: O_DIRECT reads and writes (bypass the page cache); checked at start, refused "
        "where the filesystem does not support it (e.g. tmpfs).",
    )
    posix_io_engine: Literal["psync", "aio"] = Field(
        "psync",
        description="Posix stage: I/O engine; 'psync' = thread pool of positional reads/writes, 'aio' = io_uring "
        "readv/writev with many blocks in flight (liburing; buffered, or O_DIRECT with io_direct; refused at start "
        "where io_uring is not usable).",
    )
    posix_io_threads: int = Field(8, ge=1, le=256, description="Posix stage: I/O threads per process.")
    posix_capacity_gb: float | None = Field(
        None,
        gt=0,
        description="Posix stage: most GiB of block files over all storage_backends; least recently used blocks "
        "are garbage-collected above it (null: unbounded).",
    )
    compress_mode: Literal["lossless", "fixed_rate", "off"] = Field(
        "lossless",
        description="Compress stage (KVfold): 'lossless' (bit-exact, about 1.48x on bf16 KV), 'fixed_rate' "
        "(LOSSY, size set by compress_ratio) or 'off' (stored raw). Needs a Compress stage.",
    )
    compress_ratio: int = Field(
        32,
        description="Compress stage: stored size in 1/32 of the raw size; 32 = not fixed-rate (the default, with "
        "lossless or off); 16 = 8 bits per value (int8 + a bf16 scale per (token, head)), only with compress_mode: "
        "fixed_rate. Needs a Compress stage.",
    )
    data_type: int = Field(
        0,
        description="Compress stage: KV dtype code the codec compresses, 0 = BF16 (other KV dtypes are stored "
        "raw). Needs a Compress stage.",
    )
    decompress_thread_num: int = Field(
        4,
        ge=1,
        le=1024,
        description="Compress stage: encode threads, and the most blocks decoded at once. Needs a Compress stage.",
    )

    mooncake: MooncakeConfig | None = Field(
        None,
        description="Mooncake stage: its client's settings (mooncake.json's keys). Without it, the file named by "
        "mooncake_config_path, else by the MOONCAKE_CONFIG_PATH environment variable, is read. Needs a Mooncake "
        "stage.",
    )
    mooncake_config_path: str | None = Field(
        None,
        description="Mooncake stage: path of a mooncake.json whose keys fill the mooncake section (not both). Needs "
        "a Mooncake stage.",
    )

    @model_validator(mode="before")
    @classmethod
    def _mooncake_file(cls, data: Any) -> Any:
        # The Mooncake stage's settings: inline, or the file named by the key, or by the environment variable.
        if not isinstance(data, dict):
            return data
        pipeline = data.get("store_pipeline", "")
        stages = [part.strip() for part in pipeline.split("|")] if isinstance(pipeline, str) else []
        path = data.get("mooncake_config_path")
        if "Mooncake" not in stages:
            given = [k for k in ("mooncake", "mooncake_config_path") if data.get(k) is not None]
            if given:
                raise ValueError(
                    f"{' and '.join(given)}: only for a pipeline with a Mooncake stage; store_pipeline is "
                    f"{pipeline!r}: remove them, or use e.g. 'Cache|Mooncake|Posix'"
                )
            return data
        if data.get("mooncake") is not None:
            if path is not None:
                raise ValueError(
                    f"both mooncake and mooncake_config_path ({path!r}) are given; give the settings inline or the "
                    "file, not both"
                )
            return data
        source = "mooncake_config_path"
        if path is None:
            path, source = os.environ.get(MOONCAKE_CONFIG_ENV), f"${MOONCAKE_CONFIG_ENV}"
        if not path:
            raise ValueError(
                f"store_pipeline {pipeline!r} has a Mooncake stage but no Mooncake settings; give a mooncake "
                f"section (master_server_address: host:port, ...), mooncake_config_path: <mooncake.json>, or set "
                f"{MOONCAKE_CONFIG_ENV}"
            )
        if not isinstance(path, str):
            return data  # the type check names it
        settings = _read_mooncake_json(path, source)
        if not isinstance(settings, dict):
            raise ValueError(f"the Mooncake config file {path!r} ({source}) must hold a JSON object")
        return {**data, "mooncake": settings}

    @field_validator("cache_buffer_capacity_gb", "cache_prefault_gb", "posix_capacity_gb", mode="before")
    @classmethod
    def _int_is_float(cls, value: Any) -> Any:
        # YAML writes 64 as an int; strict mode would refuse it for a float field.
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("store_pipeline")
    @classmethod
    def _known_pipeline(cls, value: str) -> str:
        normalized = "|".join(part.strip() for part in value.split("|"))
        if normalized not in SUPPORTED_PIPELINES:
            raise ValueError(
                f"store_pipeline {value!r} is not a known pipeline; allowed: "
                f"{', '.join(map(repr, SUPPORTED_PIPELINES))}"
            )
        return normalized

    @field_validator("storage_backends")
    @classmethod
    def _dirs(cls, value: str) -> str:
        if not [d for d in value.split(":") if d.strip()]:
            raise ValueError(f"storage_backends {value!r} names no directory; give one path or several joined by ':'")
        return value

    @model_validator(mode="after")
    def _compress_keys_need_compress_stage(self) -> UcmPipelineStoreConfig:
        if "Compress" not in self.store_pipeline.split("|"):
            defaults = _COMPRESS_DEFAULTS
            changed = [k for k, v in defaults.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} only apply to a pipeline with a Compress stage; "
                    f"store_pipeline is {self.store_pipeline!r}: remove them or leave the defaults {defaults}"
                )
        return self

    @model_validator(mode="after")
    def _prefault_fits_the_cache(self) -> UcmPipelineStoreConfig:
        if self.cache_prefault_gb > 0 and "Cache" not in self.store_pipeline.split("|"):
            raise ValueError(
                f"cache_prefault_gb {self.cache_prefault_gb} needs a Cache stage; store_pipeline is "
                f"{self.store_pipeline!r}: use 'Cache|Posix' or 'Cache|Compress|Posix', or leave cache_prefault_gb 0"
            )
        if self.cache_prefault_gb > self.cache_buffer_capacity_gb:
            raise ValueError(
                f"cache_prefault_gb {self.cache_prefault_gb} exceeds cache_buffer_capacity_gb "
                f"{self.cache_buffer_capacity_gb}; allowed: 0 to {self.cache_buffer_capacity_gb}"
            )
        return self

    @model_validator(mode="after")
    def _compress_settings(self) -> UcmPipelineStoreConfig:
        if self.data_type not in DATA_TYPES:
            raise ValueError(f"data_type {self.data_type!r} is not supported; allowed: 0 (bf16)")
        if self.compress_mode == "fixed_rate":
            if self.compress_ratio not in FIXED_RATE_RATIOS:
                raise ValueError(
                    f"compress_ratio {self.compress_ratio!r} is not a fixed rate this version builds; allowed with "
                    f"compress_mode: fixed_rate: {list(FIXED_RATE_RATIOS)} (16 = 8 bits per value, lossy)"
                )
        elif self.compress_ratio != COMPRESS_RATIO_OFF:
            raise ValueError(
                f"compress_ratio {self.compress_ratio!r} is a lossy fixed rate, but compress_mode is "
                f"{self.compress_mode!r}; allowed: compress_ratio: {COMPRESS_RATIO_OFF} (the default) with "
                f"compress_mode: {self.compress_mode}, or compress_mode: fixed_rate with compress_ratio in "
                f"{list(FIXED_RATE_RATIOS)} to accept lossy KV"
            )
        return self

    @property
    def storage_dirs(self) -> list[str]:
        """The directories of ``storage_backends``, in order."""
        return [d for d in self.storage_backends.split(":") if d.strip()]

    @property
    def posix_capacity_bytes(self) -> int | None:
        """``posix_capacity_gb`` in bytes (GiB = 2**30 bytes), ``None`` when unbounded."""
        return None if self.posix_capacity_gb is None else int(self.posix_capacity_gb * GIB)

    @property
    def cache_buffer_capacity_bytes(self) -> int:
        """``cache_buffer_capacity_gb`` in bytes (GiB = 2**30 bytes)."""
        return int(self.cache_buffer_capacity_gb * GIB)

    @property
    def cache_prefault_bytes(self) -> int:
        """``cache_prefault_gb`` in bytes (GiB = 2**30 bytes)."""
        return int(self.cache_prefault_gb * GIB)


class UcmConnectorEntry(_Strict):
    """One entry of ``ucm_connectors``: a named store connector and its config."""

    ucm_connector_name: Literal["UcmPipelineStore"] = "UcmPipelineStore"
    ucm_connector_config: UcmPipelineStoreConfig = Field(
        default_factory=lambda: UcmPipelineStoreConfig.model_validate({})
    )


class GSAConfig(_Strict):
    """``ucm_sparse_config.GSA``: block-sparse decode attention (see ``ucm.sparse.gsa``).

    Key names follow the seed UCM's sparse methods (``init_window_sz``, ``local_window_sz``, ``min_blocks``,
    ``sparse_ratio``); ``init_window`` / ``local_window`` are accepted as aliases.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    sparse_ratio: float = Field(
        0.3, gt=0, le=1, description="Fraction of a request's KV blocks read at decode (1.0 = all: dense result)."
    )
    init_window_sz: int = Field(
        1, ge=0, validation_alias=AliasChoices("init_window_sz", "init_window"), description="Sink blocks always kept."
    )
    local_window_sz: int = Field(
        2,
        ge=1,
        validation_alias=AliasChoices("local_window_sz", "local_window"),
        description="Most recent blocks always kept (>= 1: the block holding the current token).",
    )
    min_blocks: int = Field(
        4, ge=1, description="Requests with fewer KV blocks than this attend densely (must exceed both windows)."
    )
    block_scoring: Literal["key_bounds", "attention", "sparq"] = Field(
        "sparq",
        description="How blocks are scored: 'sparq' (every step, the current query's attention mass approximated "
        "from score_channels key components, after SparQ Attention; the most accurate), 'key_bounds' (Quest's upper "
        "bound of q.k from per-block key min/max, every step; the cheapest) or 'attention' (the exact attention "
        "mass each block got from the prompt's last observation_window queries, refreshed from the current query "
        "whenever a request starts a new block).",
    )
    observation_window: int = Field(
        16, ge=1, description="block_scoring 'attention': prompt tokens whose queries score the blocks at prefill."
    )
    score_channels: int = Field(
        16,
        ge=1,
        description="block_scoring 'sparq': key components (of head_dim) read per KV head to score blocks; "
        "head_dim or more reads them all (the exact attention mass).",
    )

    @field_validator("sparse_ratio", mode="before")
    @classmethod
    def _int_is_float(cls, value: Any) -> Any:
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _windows_below_min_blocks(self) -> GSAConfig:
        if self.min_blocks <= self.init_window_sz + self.local_window_sz:
            raise ValueError(
                f"min_blocks ({self.min_blocks}) must be larger than init_window_sz + local_window_sz "
                f"({self.init_window_sz} + {self.local_window_sz})"
            )
        return self


class ReRoPEConfig(_Strict):
    """``ucm_sparse_config.ReRoPE``: rectified rotary position embedding (see ``ucm.kernels.rerope``): relative
    positions below ``window`` as they are, larger ones read as ``window`` (or ``window + (d - window) /
    leaky_factor``), so a RoPE model runs past its trained length without training."""

    window: int = Field(
        ge=1, description="Relative positions kept as they are (below the model's trained length, e.g. half of it)."
    )
    leaky_factor: float | None = Field(
        None,
        ge=1,
        allow_inf_nan=False,
        description="Leaky ReRoPE: distances beyond the window grow 1/leaky_factor as fast (null: plain ReRoPE, "
        "every distance beyond the window read as the window).",
    )
    decode_cache_gb: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="DRAM (GiB per worker, shared evenly by the attention layers) that keeps the running requests' "
        "values and re-rotated far keys (float32) from one step to the next, so a decode step reads only its new "
        "tokens and the near band's keys; requests beyond it are recomputed whole every step (0: keep nothing). Not "
        "part of the KV cache.",
    )

    @field_validator("leaky_factor", mode="before")
    @classmethod
    def _int_is_float(cls, value: Any) -> Any:
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    def tag(self) -> str:
        """What the namespace records of it (blocks computed with ReRoPE are kept apart from dense ones)."""
        return f"rerope(window={self.window},leaky_factor={self.leaky_factor})"


class BlendLayerConfig(_Strict):
    """One entry of ``ucm_sparse_config.Blend.compute_meta``: what CacheBlend does at that attention layer."""

    ratio: float = Field(
        0.15,
        ge=0,
        le=1,
        description="Fraction of the tokens with stored KV recomputed from this layer on: those whose KV deviates "
        "most from the stored KV here, or with selection 'question' those the question attends to most (tokens "
        "without stored KV are always recomputed; 0: reuse as stored; 1: recompute all, the full prefill's result).",
    )

    @field_validator("ratio", mode="before")
    @classmethod
    def _int_is_float(cls, value: Any) -> Any:
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


ChunkContext = Literal["none", "first_chunk"]  # BlendConfig.chunk_context's values
BlendSelection = Literal["deviation", "question"]  # BlendConfig.selection's values
BLEND_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.attn$")


def default_question_layers(num_layers: int) -> tuple[int, int]:
    """``BlendConfig.question_layers``' default in a model of ``num_layers`` decoder layers: every layer after the
    first quarter, ``[ceil(num_layers / 4), num_layers)`` (``[8, 30]`` of SmolLM2's 30; ``[0, 1]`` of a one-layer
    model)."""
    return min(-(-num_layers // 4), num_layers - 1), num_layers


class BlendConfig(_Strict):
    """``ucm_sparse_config.Blend``: CacheBlend (Yao et al., EuroSys 2025, arXiv 2405.16444): reuse the stored KV of
    the prompt's chunks wherever they appear, recomputing the tokens whose KV deviates most (see
    ``ucm.integration.vllm.blend``). Key names are UCM upstream's."""

    chunk_end_token_id: int = Field(
        ge=0, description="Token id that ends each chunk of the prompt (e.g. a special token of the tokenizer)."
    )
    compute_meta: dict[str, BlendLayerConfig] = Field(
        default_factory=lambda: {"model.layers.1.self_attn.attn": BlendLayerConfig(ratio=0.15)},
        description="{attention layer name: {ratio: r}}: the layer where the tokens to recompute are chosen (all "
        "tokens are recomputed up to it); exactly one entry in this version.",
    )
    store_chunks: bool = Field(
        True,
        description="Compute a chunk the store lacks on its own (positions from 0, as if it began a prompt) and "
        "store it, so that later prompts find it in any position (false: such chunks are recomputed in place and "
        "not stored).",
    )
    chunk_context: ChunkContext = Field(
        "none",
        description="What a chunk's stored KV is computed after: 'none': nothing (positions from 0, as if it began a "
        "prompt; CacheBlend's way); 'first_chunk': the prompt's first chunk (its head: system prompt, instructions), "
        "so that the chunk's tokens see the same leading tokens as in the prompt. Its blocks are then stored under "
        "the keys of that head followed by the chunk (the prefix keys of a prompt that begins with both), and found "
        "only after the same head.",
    )
    selection: BlendSelection = Field(
        "deviation",
        description="How the recomputed tokens are chosen: 'deviation': those whose K and V recomputed at the "
        "compute_meta layer deviate most from the stored ones (CacheBlend's rule); 'question': those the prompt's "
        "tokens after the last chunk (the question) attend to most, run first over the stored KV, attention summed "
        "over question_layers (the blended KV then fits that question; vLLM's prefix cache may reuse it for another "
        "question on the same chunks).",
    )
    question_layers: list[int] | None = Field(
        None,
        description="selection 'question': the decoder layers [first, end) whose attention is summed, e.g. [8, 30]; "
        "null: every layer after the first quarter of the model's layers ([8, 30] of 30).",
    )

    @model_validator(mode="after")
    def _question_layers(self) -> BlendConfig:
        if self.question_layers is not None:
            if len(self.question_layers) != 2:
                raise ValueError(f"question_layers {self.question_layers} must be two numbers, [first, end)")
            lo, hi = self.question_layers
            if self.selection != "question":
                raise ValueError(
                    f"question_layers {self.question_layers} is set but selection is {self.selection!r}; it "
                    "applies to selection 'question' only"
                )
            if not 0 <= lo < hi:
                raise ValueError(f"question_layers {self.question_layers} must be [first, end) with 0 <= first < end")
        return self

    @field_validator("compute_meta")
    @classmethod
    def _one_layer(cls, value: dict[str, BlendLayerConfig]) -> dict[str, BlendLayerConfig]:
        if len(value) != 1:
            raise ValueError(
                f"compute_meta has {len(value)} entries ({sorted(value)}); this version takes exactly 1, e.g. "
                "{'model.layers.1.self_attn.attn': {ratio: 0.15}}"
            )
        name = next(iter(value))
        if not BLEND_LAYER_RE.match(name):
            raise ValueError(
                f"compute_meta key {name!r} is not an attention layer name; allowed: 'model.layers.<i>.self_attn.attn'"
            )
        return value

    @property
    def check_layer(self) -> int:
        """Index of the decoder layer named in ``compute_meta``."""
        match = BLEND_LAYER_RE.match(next(iter(self.compute_meta)))
        assert match is not None  # validated
        return int(match.group(1))

    @property
    def ratio(self) -> float:
        """The recompute ratio of ``compute_meta``'s layer."""
        return next(iter(self.compute_meta.values())).ratio


class UcmSparseConfig(_Strict):
    """``ucm_sparse_config``: at most one attention method, keyed by its name."""

    GSA: GSAConfig | None = Field(None, description="Block-sparse decode attention (Quest-style key bounds).")
    ReRoPE: ReRoPEConfig | None = Field(
        None, description="Rectified RoPE past the trained length, e.g. {window: 128} (ucm.kernels.rerope)."
    )

    Blend: BlendConfig | None = Field(
        None,
        description="CacheBlend: reuse the stored KV of non-prefix chunks, e.g. {chunk_end_token_id: 2, compute_meta: "
        "{'model.layers.1.self_attn.attn': {ratio: 0.15}}} (ucm.integration.vllm.blend).",
    )

    @model_validator(mode="after")
    def _one_method(self) -> UcmSparseConfig:
        on = [name for name in ("GSA", "ReRoPE", "Blend") if getattr(self, name) is not None]
        if len(on) > 1:
            both = "both" if len(on) == 2 else "all"
            raise ValueError(f"{' and '.join(on)} are {both} set; this version runs one attention method: keep one")
        return self

    @property
    def method(self) -> str | None:
        """The name of the method switched on, or ``None``."""
        return next((name for name in ("GSA", "ReRoPE", "Blend") if getattr(self, name) is not None), None)


class UcmConfig(_Strict):
    """The whole UCM config (top level of the YAML)."""

    ucm_connectors: list[UcmConnectorEntry] = Field(
        default_factory=lambda: [UcmConnectorEntry.model_validate({})],
        description="Store connectors; this version takes exactly one UcmPipelineStore.",
    )
    enable_event_sync: bool = Field(
        True,
        description="Accepted; no effect in this version: the gather runs on the compute stream after the forward "
        "pass (device builds) or synchronously (CPU), so it always sees the step's KV.",
    )
    use_layerwise: bool = Field(
        False,
        description="Layer-by-layer transfer: a step's loads are read layer shard by layer shard and each layer is "
        "scattered just before its attention (layer i+1 still arriving while layer i computes); dumps are gathered "
        "layer by layer right after each layer's attention. Same stored bytes as blockwise.",
    )
    reset_clears_storage: bool = Field(
        False,
        description="What vLLM's reset of external caches (POST /reset_prefix_cache?reset_external=true) clears: "
        "false = UCM's DRAM tier only (stored blocks stay, and serve the next requests); true = also every block "
        "file of this model's namespace in storage_backends (other models' blocks are kept).",
    )
    load_timeout_ms: float = Field(
        10000.0,
        gt=0,
        allow_inf_nan=False,
        description="Most ms a step waits for a load from UCM's store (blockwise: the whole load; layerwise: until its "
        "last layer), for a Posix lookup, and for a durable dump (prefill for another instance). Past it the blocks "
        "not yet in are reported failed and vLLM recomputes them; a lookup is a miss; a durable dump's response "
        "leaves without waiting longer.",
    )
    enable_metrics: bool = Field(
        True,
        description="UCM's metrics on vllm serve's /metrics (per tier: lookups, hits, bytes, latency, failures, "
        "levels; docs/operations.md). false: UCM records and sends none (its per-request log line stays).",
    )
    enable_record_traces: bool = Field(
        False,
        description="Write a JSONL trace of lookups, loads and dumps (request ids, tier, blocks, bytes, ms), one file "
        "per process and connector role (ucm.store.traces).",
    )
    record_traces_dir: str | None = Field(
        None,
        description="Directory of the trace files (null: 'traces' in the first storage_backends directory). Needs "
        "enable_record_traces: true.",
    )
    record_traces_max_mb: float = Field(
        DEFAULT_TRACE_MAX_MB,
        ge=0.001,
        description="MiB at which a trace file is rotated (renamed to <file>.1, replacing the previous one), so a "
        "process keeps at most twice this per role. Needs enable_record_traces: true.",
    )
    ucm_sparse_config: UcmSparseConfig | None = Field(
        None, description="Sparse attention at decode, e.g. {GSA: {sparse_ratio: 0.3}} (null: dense)."
    )

    @field_validator("reset_clears_storage", mode="before")
    @classmethod
    def _reset_choice(cls, value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError(
                "not a boolean; allowed: false (a reset empties the DRAM tier, stored blocks stay) or true (a reset "
                "also deletes this model's block files)"
            )
        return value

    @field_validator("ucm_connectors")
    @classmethod
    def _one_connector(cls, value: list[UcmConnectorEntry]) -> list[UcmConnectorEntry]:
        if len(value) != 1:
            raise ValueError(f"ucm_connectors has {len(value)} entries; this UCM version takes exactly 1")
        return value

    @field_validator("record_traces_max_mb", "load_timeout_ms", mode="before")
    @classmethod
    def _int_is_float(cls, value: Any) -> Any:
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _trace_keys_need_traces(self) -> UcmConfig:
        if not self.enable_record_traces:
            changed = [k for k in ("record_traces_dir", "record_traces_max_mb") if k in self.model_fields_set]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} only apply with enable_record_traces: true; set it, or remove them"
                )
        return self

    @property
    def traces_dir(self) -> str:
        """Where trace files go: ``record_traces_dir``, else ``traces`` in the first storage directory."""
        if self.record_traces_dir is not None:
            return self.record_traces_dir
        return os.path.join(self.store.storage_dirs[0], "traces")

    @property
    def traces_max_bytes(self) -> int:
        """``record_traces_max_mb`` in bytes (MiB = 2**20 bytes)."""
        return int(self.record_traces_max_mb * 2**20)

    @property
    def load_timeout_s(self) -> float:
        """``load_timeout_ms`` in seconds."""
        return self.load_timeout_ms / 1e3

    @property
    def store(self) -> UcmPipelineStoreConfig:
        """The config of the (single) UcmPipelineStore."""
        return self.ucm_connectors[0].ucm_connector_config

    def to_log_dict(self) -> dict[str, Any]:
        """The config with every default filled in, as a plain dict (for the start-up log line)."""
        return self.model_dump(mode="json")


def _valid_keys(model: type[BaseModel]) -> str:
    return ", ".join(sorted(model.model_fields))


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel]:
    """The schema model that owns the key at ``loc`` (for naming valid keys in an unknown-key error)."""
    names = [part for part in loc if isinstance(part, str)]
    if "GSA" in names:
        return GSAConfig
    if "ReRoPE" in names:
        return ReRoPEConfig
    if "compute_meta" in names:
        return BlendLayerConfig
    if "Blend" in names:
        return BlendConfig
    if "mooncake" in names:
        return MooncakeConfig
    if "ucm_sparse_config" in names:
        return UcmSparseConfig
    if "ucm_connector_config" in names:
        return UcmPipelineStoreConfig
    if "ucm_connectors" in names:
        return UcmConnectorEntry
    return UcmConfig


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        if e["type"] == "extra_forbidden":
            parent = _format_loc(loc[:-1])
            lines.append(f"unknown key {loc[-1]!r} in {parent}; valid keys: {_valid_keys(_model_at(loc[:-1]))}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{_format_loc(loc)}: {msg} (got {e.get('input')!r})")
    return f"invalid UCM config ({source}):\n  " + "\n  ".join(lines)


def parse_config(data: dict[str, Any] | None, source: str = "inline") -> UcmConfig:
    """Validate a config mapping (the YAML's top level) and fill in defaults.

    Raises:
        UcmConfigError: unknown keys, wrong types or unsupported values, each named with the allowed ones.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UcmConfigError(
            f"invalid UCM config ({source}): the top level must be a mapping, got {type(data).__name__}"
        )
    try:
        return UcmConfig.model_validate(data)
    except ValidationError as err:
        raise UcmConfigError(_format_errors(err, source)) from None


def load_config_file(path: str | os.PathLike[str]) -> UcmConfig:
    """Read and validate a UCM YAML file.

    Raises:
        UcmConfigError: the file is missing or unreadable, is not valid YAML, or fails validation.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        where = "" if p.is_absolute() else f", relative to the working directory {os.getcwd()!r}"
        raise UcmConfigError(
            f"cannot read UCM config file {str(p)!r} ({CONFIG_FILE_KEY}{where}): {err.strerror}"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UcmConfigError(f"UCM config file {str(p)!r} is not valid YAML: {err}") from None
    return parse_config(data, source=str(p))


def config_from_extra_config(extra: dict[str, Any] | None) -> UcmConfig:
    """The UCM config from vLLM's ``kv_connector_extra_config``.

    Either ``{"UCM_CONFIG_FILE": "<path>"}`` (nothing else) or the config's keys inline; an empty or missing
    mapping gives the defaults (``Cache|Posix`` over ``./.ucm_store``).

    Raises:
        UcmConfigError: both a file and inline keys are given, or the config is invalid.
    """
    extra = dict(extra or {})
    if CONFIG_FILE_KEY in extra:
        path = extra.pop(CONFIG_FILE_KEY)
        if extra:
            raise UcmConfigError(
                f"kv_connector_extra_config has {CONFIG_FILE_KEY} and inline keys {sorted(extra)}; "
                f"give either the file or the keys inline, not both"
            )
        if not isinstance(path, (str, os.PathLike)):
            raise UcmConfigError(f"{CONFIG_FILE_KEY} must be a path string, got {path!r}")
        return load_config_file(path)
    return parse_config(extra, source="kv_connector_extra_config")
