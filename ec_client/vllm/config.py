"""ConnectorConfig: what the connector takes from vLLM's config, parsed and checked once.

Both sides of an engine (the scheduler process and every worker) build it from the same
VllmConfig, so they agree on the pool without talking to each other. vLLM passes
`ec_connector_extra_config` through untouched: a value given on the command line as a JSON string
stays a string, so every number here is parsed from an int or a string alike.

Keys of `ec_connector_extra_config`:

- `ec_cpu_bytes` (required): pool capacity in bytes (`8589934592` or `"8GiB"`). Every engine on
  a shared pool must give the same value: the daemon refuses a second geometry.
- `ecd_address`: the daemon's gRPC target; default `ECD_ADDRESS`, else the default socket.
- `ecd_pool`: the pool's name. Default `<instance_id>_dp<rank>`, as ECCPUConnector names its
  region: private to this engine and this run, dropped at shutdown. Name a pool to share it
  between engines (a producer and a consumer engine) or to keep it across engine restarts.
- `ecd_wait_ms`: how long a consumer holds a request back while an item it needs is not in the
  pool yet (another engine may be encoding it), before encoding it itself. Default 0.
- `ecd_idle_wait_ms`: while requests are held back for items other engines are encoding (or
  for `ecd_wait_ms`), how long a step that scheduled nothing waits for the pool to change
  before the engine steps again; the commit or abort of a PENDING item (or any other event of
  the pool) ends the wait at once. Default 50: an idle engine steps about 20 times a second
  while it waits, instead of hundreds, and a new request that reaches an engine doing nothing
  else waits at most this long more. 0 steps at once, as vLLM would.
- `ecd_connect_timeout_s`: how long to wait for the daemon at start, and how long one call
  retries while the daemon restarts. A call made while no daemon is there at all (no socket,
  nothing listening) fails at once: the scheduler's steps never wait on it. Also the most a
  producer's answers wait for an Allocate not answered yet (SchedulerSide's
  `_allocated_before_answer`). Default 2.
- `ecd_cluster_namespace`: the namespace the pool's entries are shared under in the daemon's
  Mooncake Store (OpenPool's cluster_namespace, docs/design.md §13). `"auto"` (the default): the
  one vLLM's own store connector (`mooncake_store_embedding`) derives from the same config, set
  only when the daemon has a store, so that both name an image the same way; `""`: the pool
  stays on its node; any other string: that namespace. `embedding_cache_prefix` and
  `embedding_model_identity`, vLLM's store connector's keys, change the derived namespace as
  they change vLLM's.

A key of the `ecd_` family that is none of these (nor one of those below) stops the engine at
start, naming the closest setting ("did you mean ..."): a misspelt `ecd_pool` would give a
private pool, dropped at shutdown, and nobody would know. Any other key this connector does not
read (a setting of another connector, left in a shared config) is warned about, once.

`ecd_pins` and `ecd_pin_share` (of earlier versions: when cached items were pinned by a round
trip on the scheduler thread) are ignored, with a warning: cached items are now pinned with no
round trip (lock pins, see loads.py), so there is nothing left to choose. So is
`ecd_pending_wait_ms` (a cap on how long a request waited for an item being encoded elsewhere):
such a request now waits until that encode is committed or aborted, and the daemon bounds how
long that can be (docs/design.md §4, *Single flight*).
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ec_client.control._connection import Options, await_daemon
from ec_client.data.mover import dtype_name
from ec_protocol.pool.layout import ENGINE_ID_PATTERN
from ec_protocol.types import Role, TensorSpec
from ec_protocol.units import parse_size

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("ec_client.vllm")

# Settings of earlier versions that mean nothing now: accepted (an engine upgraded with its old
# config still starts), with a warning saying why.
_NO_ROUND_TRIP = "cached items are pinned with no round trip now, whatever it says"
IGNORED = {
    "ecd_pins": _NO_ROUND_TRIP,
    "ecd_pin_share": _NO_ROUND_TRIP,
    "ecd_pending_wait_ms": "a request waits for an item being encoded elsewhere until that "
    "encode is committed or aborted (the daemon's --pending-timeout bounds it)",
}


# Every key of ec_connector_extra_config the connector reads (the module docstring says what
# each does): `ecd_` ones, the capacity (ECCPUConnector's name for it), and the two of vLLM's
# store connector that change the namespace "auto" derives.
SETTINGS = (
    "ec_cpu_bytes",
    "ecd_address",
    "ecd_pool",
    "ecd_wait_ms",
    "ecd_idle_wait_ms",
    "ecd_connect_timeout_s",
    "ecd_cluster_namespace",
    "embedding_cache_prefix",
    "embedding_model_identity",
)
OURS = "ecd_"  # the prefix of this connector's own keys


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings and the pool's identity and geometry.

    Invariant: two engines compute the same (pool, block_size_bytes, capacity_bytes, compat_key)
    exactly when they may share cache entries; the daemon refuses any other combination.
    """

    address: str | None  # None: the client's default (ECD_ADDRESS, else the default socket)
    pool: str
    pool_is_private: bool  # the default, per-run name: nobody else can find it, so drop it at end
    capacity_bytes: int
    block_size_bytes: int  # one row of the LM's input embeddings: width x dtype size
    dtype: str  # the model dtype, the dtype of every stored encoder output
    compat_key: str
    is_producer: bool
    is_consumer: bool
    # Whether the scheduler reads the pool before it encodes (promises vLLM what the pool holds,
    # holds a request for what another engine is writing): a consumer, or an encoder-only
    # producer (`--mm-encoder-only`), which needs the output nowhere but in the pool. A producer
    # that runs the whole model does not: vLLM loads into its workers only on a consumer (it
    # calls start_load_caches there alone), so its forward pass needs the output encoded there.
    reads_pool: bool
    wait_s: float
    idle_wait_s: float
    connect_timeout_s: float
    load_reports: int  # distinct worker ranks that must report a load before its pin goes
    # Each scheduler hears only its own worker (executor "uni", or "external_launcher", where
    # every rank is an engine of its own): that worker saves and reports for itself.
    worker_is_alone: bool
    client_name: str
    # OpenPool's cluster_namespace ("" keeps the pool on its node); `namespace_if_store`: asked
    # only of a daemon that has a store ("auto": an engine config is the same on every node,
    # with a store or without).
    cluster_namespace: str
    namespace_if_store: bool

    def await_daemon(self) -> None:
        """Return once the daemon answers a connection, within connect_timeout_s (it may be
        starting alongside the engine), else UNAVAILABLE. The connector's clients wait for it
        here only, not at every call (their wait_for_daemon_s is 0): a call made while no daemon
        is there fails at once."""
        t = self.connect_timeout_s
        await_daemon(Options.make(self.address, None, Role.BOTH, t, t, None), t)

    def loadable(self, spec: TensorSpec) -> bool:
        """Encoder outputs are (rows, width) in the model dtype, a row as wide as a block (the
        model's width); anything else is not ours. The daemon reads a value of any width from
        its store (it does not know the model's): another model's, under a namespace that
        names this model, is never loaded here."""
        return (
            len(spec.shape) == 2
            and spec.dtype == self.dtype
            and spec.nbytes == spec.shape[0] * self.block_size_bytes
        )

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ConnectorConfig:
        import vllm

        ec = vllm_config.ec_transfer_config
        if ec is None:
            raise ValueError("ECDaemonConnector needs an ec_transfer_config")
        extra: dict[str, Any] = dict(ec.ec_connector_extra_config or {})
        check_keys(extra)
        _warn_ignored(extra)
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        # What VllmConfig.is_mm_encoder_only reads, asked of model_config so that a stand-in
        # config (ec_client/vllm/offline.py) answers it too.
        multimodal = model.multimodal_config
        encoder_only = multimodal is not None and multimodal.mm_encoder_only
        _warn_if_images_are_named_by_request(vllm_config)
        dtype, width, capacity = _geometry(vllm_config, extra)
        name = dtype_name(dtype)
        pool, private = _pool_name(vllm_config, extra)
        address = extra.get("ecd_address")
        # Only the first pipeline stage builds input embeddings, so its TP x PCP workers are the
        # ones that load; a pin may go once each of them reported its copy landed.
        loaders = parallel.tensor_parallel_size * parallel.prefill_context_parallel_size
        alone = _worker_is_alone(parallel.distributed_executor_backend, loaders)
        namespace = _namespace_setting(extra)
        return cls(
            address=str(address) if address else None,
            pool=pool,
            pool_is_private=private,
            capacity_bytes=capacity,
            block_size_bytes=width * dtype.itemsize,
            dtype=name,
            compat_key=f"{model.model}|{name}|{width}|vllm {vllm.__version__}",
            is_producer=bool(ec.is_ec_producer),
            is_consumer=bool(ec.is_ec_consumer),
            reads_pool=bool(ec.is_ec_consumer) or (bool(ec.is_ec_producer) and encoder_only),
            wait_s=_number(extra, "ecd_wait_ms", 0) / 1000,
            idle_wait_s=_number(extra, "ecd_idle_wait_ms", 50) / 1000,
            connect_timeout_s=_number(extra, "ecd_connect_timeout_s", 2),
            load_reports=1 if alone else loaders,
            worker_is_alone=alone,
            client_name=f"vllm-{pool}-pid{os.getpid()}",
            cluster_namespace=(
                embedding_namespace(vllm_config, extra) if namespace == AUTO else namespace
            ),
            namespace_if_store=namespace == AUTO,
        )


def _warn_if_images_are_named_by_request(vllm_config: VllmConfig) -> None:
    if images_are_named_by_request(vllm_config):
        log.warning(
            "this engine names each image by its request, not its content: with prefix "
            "caching off and mm_processor_cache_gb=0, vLLM gives an image without a "
            "multi_modal_uuid an identifier of its request, so no encoder cache (ecd's or "
            "vLLM's own) can ever find it again and every image is encoded anew. Set "
            "--mm-processor-cache-gb above 0 (or keep prefix caching on), or send "
            "multi_modal_uuids with the requests"
        )


def _warn_ignored(extra: dict[str, Any]) -> None:
    """Say which settings of earlier versions are given and mean nothing now (IGNORED)."""
    for key, why in IGNORED.items():
        if key in extra:
            log.warning(
                "ec_connector_extra_config %s=%r is ignored: %s; remove it",
                key,
                extra[key],
                why,
            )


def _geometry(vllm_config: VllmConfig, extra: dict[str, Any]) -> tuple[torch.dtype, int, int]:
    """The model's dtype, its embedding width (a block is one row) and the pool's capacity,
    which holds at least one block."""
    model = vllm_config.model_config
    dtype = model.dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model dtype {dtype!r} is not a torch dtype")
    width = int(model.get_inputs_embeds_size())
    capacity = _size(extra, "ec_cpu_bytes")
    block = width * dtype.itemsize
    if capacity < block:
        raise ValueError(
            f"ec_cpu_bytes={capacity} is smaller than one block ({block} bytes: embedding "
            f"width {width} x {dtype.itemsize}-byte {dtype_name(dtype)})"
        )
    return dtype, width, capacity


def _pool_name(vllm_config: VllmConfig, extra: dict[str, Any]) -> tuple[str, bool]:
    """The pool's name (`ecd_pool`), and whether it is the private default, named for this run
    as ECCPUConnector names its region."""
    pool = extra.get("ecd_pool")
    private = pool is None
    if private:
        pool = f"{vllm_config.instance_id}_dp{vllm_config.parallel_config.data_parallel_index}"
    if not isinstance(pool, str) or not ENGINE_ID_PATTERN.fullmatch(pool):
        raise ValueError(
            f"ecd_pool {pool!r} is not a pool name: use 1-128 of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return pool, private


def _namespace_setting(extra: dict[str, Any]) -> str:
    """`ecd_cluster_namespace` as given: AUTO, "" or a namespace."""
    namespace = extra.get("ecd_cluster_namespace", AUTO)
    if not isinstance(namespace, str):
        raise ValueError(
            f'ecd_cluster_namespace must be a string ("auto", "" or a namespace), got {namespace!r}'
        )
    return namespace


AUTO = "auto"
# vLLM 0.33's EMBEDDING_CACHE_KEY_VERSION (mooncake_store_embedding/data.py): the namespace's last
# part, which vLLM changes when its key or value format changes.
EMBEDDING_KEY_VERSION = "v3"


def embedding_namespace(vllm_config: VllmConfig, extra: dict[str, Any]) -> str:
    """The namespace vLLM's own store connector derives from this config
    (`build_embedding_namespace`, mooncake_store_embedding/data.py, vLLM 0.33), built the same
    way here rather than imported: vLLM 0.32 has no such module. tests/vllm/test_config.py
    checks it against vLLM's function."""
    model = vllm_config.model_config
    multimodal = model.multimodal_config
    encoder = multimodal.compute_hash() if multimodal is not None else "encoder:default"
    cache_prefix = str(extra.get("embedding_cache_prefix", ""))
    model_name = str(extra.get("embedding_model_identity", model.model))
    prefix = f"{cache_prefix}@" if cache_prefix else ""
    return (
        f"{prefix}embedding"
        f"@model:{model_name}"
        f"@revision:{model.revision or 'default'}"
        f"@encoder:{encoder}"
        f"@dtype:{model.dtype}"
        f"@protocol:{EMBEDDING_KEY_VERSION}"
    )


def images_are_named_by_request(vllm_config: VllmConfig) -> bool:
    """Whether vLLM names an image without a caller-given multi_modal_uuid after its request
    (`{request id}-image-0`) rather than its content: it skips content hashing when neither the
    prefix cache nor the multimodal processor cache would use the hash (renderers/base.py,
    `_process_mm_uuids`, vLLM 0.32 and 0.33). An encoder-only engine (ec_producer) has prefix
    caching turned off by vLLM itself, so there the processor cache at 0 alone does it."""
    multimodal = vllm_config.model_config.multimodal_config
    return (
        multimodal is not None
        and multimodal.mm_processor_cache_gb == 0
        and not vllm_config.cache_config.enable_prefix_caching
    )


def check_keys(extra: dict[str, Any]) -> None:
    """Refuse a key of ours (`ecd_...`) that is no setting, naming the closest one: a typo
    there changes the deployment silently (a misspelt ecd_pool gives a private pool). Warn of
    any other key not read here, once: it may be another connector's, in a config shared."""
    known = [*SETTINGS, *IGNORED]
    unknown = [str(key) for key in extra if key not in known]
    for key in unknown:
        if key.startswith(OURS):
            raise ValueError(
                f"ec_connector_extra_config has no setting {key!r}{_did_you_mean(key, known)}; "
                f"ECDaemonConnector's settings: {', '.join(SETTINGS)}"
            )
    if unknown:
        log.warning(
            "ec_connector_extra_config: %s %s not read by ECDaemonConnector and ignored",
            ", ".join(f"{key!r}{_did_you_mean(key, known)}" for key in unknown),
            "is" if len(unknown) == 1 else "are",
        )


def _did_you_mean(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _size(extra: dict[str, Any], key: str) -> int:
    value = extra.get(key)
    if value is None or isinstance(value, bool):
        raise ValueError(
            f"{key} must be given in ec_connector_extra_config (pool capacity in bytes, "
            'e.g. 8589934592 or "8GiB")'
        )
    try:
        size = parse_size(value if isinstance(value, int) else str(value))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    if size <= 0:
        raise ValueError(f"{key} must be positive, got {value!r}")
    return size


def _number(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a number, got {value!r}") from None
    if number < 0:
        raise ValueError(f"{key} must not be negative, got {value!r}")
    return number


def _worker_is_alone(backend: object, loaders: int) -> bool:
    """Whether the executor hands the scheduler one worker's output rather than every worker's.

    MultiprocExecutor and its subclasses (RayExecutorV2 among them) fold every worker's EC
    output (vLLM's ECOutputAggregator), so the scheduler can wait for each loading worker. Under
    "uni" and "external_launcher" each scheduler has exactly one worker. Any other executor
    hands over one rank's output at most: with more than one loading worker, a pin would go
    while the others may still be copying, so it is refused.
    """
    if backend in ("uni", "external_launcher"):
        return True
    if backend in ("mp", "ray"):
        return False
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    executor = resolve_obj_by_qualname(backend) if isinstance(backend, str) else backend
    if isinstance(executor, type) and issubclass(executor, MultiprocExecutor):
        return False
    if loaders == 1:
        return True
    raise ValueError(
        f"ECDaemonConnector cannot tell when all {loaders} tensor/context-parallel workers "
        f"finished a load with the executor {backend!r}: use distributed_executor_backend "
        '"mp" or "ray", whose executors report every worker\'s copies'
    )
