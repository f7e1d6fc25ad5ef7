"""`make gpu-check`: the one command a bare GPU machine runs (docs/performance.md, "The CUDA path
on a GPU").

In order, each section's figures written to $ECD_GPU_OUT/gpu-check.json as soon as it ends (so a
run cut short still leaves what it measured), then printed as a table:

1. environment: versions, the GPU, where pools live;
2. smoke: a daemon started with this checkout, a put and a get through it;
3. tests: `pytest tests/gpu` with ECD_REQUIRE_GPU (1 unless told: no CUDA is then a failure);
4. the benchmark, on CUDA only, every figure a ratio of two things measured side by side in this
   run (medians; the order alternates): copies from a registered pool extent vs from pinned
   memory, an entry in 40 extents vs one, saves and loads at once vs each alone, put/get vs the
   bare copy, and loading one image's embeddings vs running a ViT-L-sized encoder on the image.

Exit status: 0 when the tests passed (and found CUDA if required); the targets are reported, not
enforced (they are for an H200 on PCIe Gen5). Kept out of ec_client: it is a verification tool
with its own dependencies (transformers or timm), not part of what engines import.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402
from ecd_testing import running_daemon  # noqa: E402
from gpu_testing import free_bytes, pools_with_room  # noqa: E402

from ec_client import Client, Consumer, Producer  # noqa: E402
from ec_client.data.mapping import PoolMapping  # noqa: E402
from ec_client.data.mover import TensorMover, Transfer  # noqa: E402
from ec_protocol.types import AllocateItem, Extent, TensorSpec  # noqa: E402

MiB = 1 << 20
BLOCK = 7168  # one row of Qwen2.5-VL-7B: 3584 x bf16
POOL_BYTES = 1 << 30
SCRATCH = "bench-scratch"
SCRATCH_BYTES = 160 * MiB  # two 64 MiB entries, and one in 40 extents with a gap after each
BUDGET_S = float(os.environ.get("ECD_GPU_BUDGET_S", "240"))  # sections start only within this
TESTS_TIMEOUT_S = 150
RUNS = 15

# (section, figure, least value) on an H200 over PCIe Gen5.
TARGETS = [
    ("copies", "h2d_8MiB_ratio", 0.9),
    ("copies", "d2h_8MiB_ratio", 0.9),
    ("copies", "h2d_64MiB_ratio", 0.9),
    ("copies", "d2h_64MiB_ratio", 0.9),
    ("extents", "h2d_ratio", 0.8),
    ("extents", "d2h_ratio", 0.8),
    ("concurrent", "ratio", 1.6),
]


class Report:
    """The run's figures, rewritten whole to `path` after every section."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": _now(), "sections": {}}
        self.started = time.monotonic()

    def add(self, name: str, figures: dict[str, Any]) -> None:
        self.data["sections"][name] = figures
        self.data["elapsed_s"] = round(time.monotonic() - self.started, 1)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        temporary.replace(self.path)
        print(f"[{self.data['elapsed_s']:6.1f} s] {name}: {_brief(figures)}", flush=True)

    def over_budget(self) -> bool:
        return time.monotonic() - self.started > BUDGET_S


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _brief(figures: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in figures.items() if not isinstance(v, dict | list))


def environment(pool_dir: Path) -> dict[str, Any]:
    import google.protobuf
    import grpc

    figures: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "cuda_available": torch.cuda.is_available(),
        "pool_dir": str(pool_dir),
        "pool_dir_free_gib": round(free_bytes(pool_dir) / (1 << 30), 1),
        "require_gpu": os.environ.get("ECD_REQUIRE_GPU", "1"),
    }
    if torch.cuda.is_available():
        figures["device"] = torch.cuda.get_device_name()
        figures["device_count"] = torch.cuda.device_count()
    return figures


def smoke(client: Client) -> dict[str, Any]:
    """The daemon runs on this machine's packages and the shipped wheels, and moves bytes."""
    client.open_pool("smoke", BLOCK, 64 * MiB // BLOCK * BLOCK)
    tensor = torch.randint(0, 256, (8 * MiB,), dtype=torch.uint8)
    stored = Producer(client, "smoke").put("smoke", tensor)
    loaded = Consumer(client, "smoke").get("smoke")
    return {
        "daemon": client.target,
        "put": stored.value,
        "get_bit_identical": loaded is not None and torch.equal(loaded, tensor),
    }


def run_tests(out_dir: Path) -> dict[str, Any]:
    # Only the plugins the suite needs, by module: whatever else the machine has installed may
    # not fit the pytest shipped in the wheels.
    env = {
        **os.environ,
        "ECD_REQUIRE_GPU": os.environ.get("ECD_REQUIRE_GPU", "1"),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    plugins = ["-p", "pytest_asyncio.plugin", "-p", "pytest_timeout", "-p", "no:cacheprovider"]
    command = [sys.executable, "-m", "pytest", "tests/gpu", "-v", "-rA", *plugins]
    log = out_dir / "pytest.log"
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S
        )
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as timeout:
        code = -1
        partial = timeout.stdout.decode() if isinstance(timeout.stdout, bytes) else ""
        output = f"{partial}\npytest ran past {TESTS_TIMEOUT_S} s and was stopped"
    log.write_text(output)
    lines = [line for line in output.splitlines() if line.strip()]
    print("\n".join(lines[-40:]), flush=True)
    return {
        "exit_code": code,
        "summary": lines[-1].strip("= ") if lines else "(no output)",
        "seconds": round(time.monotonic() - started, 1),
        "log": str(log),
    }


# ---- the benchmark ------------------------------------------------------------------------------


def seconds(operation: Callable[[], object]) -> float:
    """Wall time of `operation` with the device idle before and drained after."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    operation()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def side_by_side(operations: dict[str, Callable[[], object]], runs: int = RUNS) -> dict[str, float]:
    """Median seconds of each operation, runs interleaved (and their order alternated) so drift
    and clocks hit them alike; one warm-up round first."""
    names = list(operations)
    for name in names:
        seconds(operations[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for run in range(runs):
        for name in names if run % 2 == 0 else reversed(names):
            times[name].append(seconds(operations[name]))
    return {name: statistics.median(values) for name, values in times.items()}


def gbs(nbytes: int, time_s: float) -> float:
    return round(nbytes / time_s / 1e9, 2)


def landed(transfer: Transfer) -> None:
    transfer.wait()


class Bench:
    """The benchmark's pool, mover and scratch tensors."""

    def __init__(self, client: Client) -> None:
        self.client = client
        info = client.open_pool("bench", BLOCK, POOL_BYTES // BLOCK * BLOCK)
        self.mapping = PoolMapping.open(info)
        self.mover = TensorMover(self.mapping, "cuda")
        self.device = self.mover.device
        # Bare copies go to blocks the benchmark owns: a PENDING entry it never commits.
        [scratch] = client.allocate("bench", [AllocateItem(SCRATCH, (SCRATCH_BYTES,), "uint8")])
        [self.scratch] = scratch.extents  # a fresh pool: one extent

    def close(self) -> None:
        self.client.abort("bench", [SCRATCH])

    def extent(self, nbytes: int, after: int = 0) -> list[Extent]:
        """Scratch blocks for `nbytes`, starting `after` blocks into the scratch entry."""
        return [Extent(self.scratch.start + after, blocks(nbytes))]

    def copies(self) -> dict[str, Any]:
        """One entry's bytes between its registered pool extent and the GPU vs the same bytes
        between a pin_memory() tensor and the GPU, both by torch's copy_ (the memory compared:
        `ratio`, the target), and by the mover (its own overhead included: `mover_ratio`)."""
        figures: dict[str, Any] = {"registered": self.mapping.cuda_registered}
        for size in (8 * MiB, 64 * MiB):
            figures.update(self._copies(size))
        return figures

    def _copies(self, size: int) -> dict[str, Any]:
        label = f"{size // MiB}MiB"
        extent, spec = self.extent(size), TensorSpec((size,), "uint8", size)
        region = self.mapping.region(extent[0])[:size]
        device = torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.device)
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        out = torch.empty_like(device)
        t = side_by_side(
            {
                "pool_h2d": lambda: out.copy_(region, non_blocking=True),
                "pinned_h2d": lambda: out.copy_(pinned, non_blocking=True),
                "mover_h2d": lambda: landed(self.mover.load(extent, spec, out)[1]),
                "pool_d2h": lambda: region.copy_(device, non_blocking=True),
                "pinned_d2h": lambda: pinned.copy_(device, non_blocking=True),
                "mover_d2h": lambda: landed(self.mover.save(device, extent)),
            }
        )
        figures: dict[str, Any] = {}
        for way in ("h2d", "d2h"):
            for source in ("pool", "pinned", "mover"):
                figures[f"{way}_{label}_{source}_gbs"] = gbs(size, t[f"{source}_{way}"])
            figures[f"{way}_{label}_ratio"] = round(t[f"pinned_{way}"] / t[f"pool_{way}"], 3)
            figures[f"{way}_{label}_mover_ratio"] = round(t[f"pinned_{way}"] / t[f"mover_{way}"], 3)
        return figures

    def extents(self) -> dict[str, Any]:
        """A 64 MiB entry in 40 extents (scattered, a gap after each) vs in one."""
        size = 64 * MiB
        one = self.extent(size)
        forty = scattered(blocks(size), 40, start=self.scratch.start + blocks(size))
        spec = TensorSpec((size,), "uint8", size)
        device = torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.device)
        out = torch.empty_like(device)
        t = side_by_side(
            {
                "one_h2d": lambda: landed(self.mover.load(one, spec, out)[1]),
                "forty_h2d": lambda: landed(self.mover.load(forty, spec, out)[1]),
                "one_d2h": lambda: landed(self.mover.save(device, one)),
                "forty_d2h": lambda: landed(self.mover.save(device, forty)),
            }
        )
        figures: dict[str, Any] = {}
        for way in ("h2d", "d2h"):
            figures[f"{way}_one_gbs"] = gbs(size, t[f"one_{way}"])
            figures[f"{way}_forty_gbs"] = gbs(size, t[f"forty_{way}"])
            figures[f"{way}_ratio"] = round(t[f"one_{way}"] / t[f"forty_{way}"], 3)
        return figures

    def concurrent(self) -> dict[str, Any]:
        """A 64 MiB save and a 64 MiB load launched together vs each alone (one mover: its save
        and load streams)."""
        size = 64 * MiB
        spec = TensorSpec((size,), "uint8", size)
        device = torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.device)
        out = torch.empty_like(device)
        saves, loads = self.extent(size), self.extent(size, after=blocks(size))

        def both() -> None:
            saving = self.mover.save(device, saves)
            _, loading = self.mover.load(loads, spec, out)
            saving.wait()
            loading.wait()

        t = side_by_side(
            {
                "save": lambda: landed(self.mover.save(device, saves)),
                "load": lambda: landed(self.mover.load(loads, spec, out)[1]),
                "both": both,
            }
        )
        return {
            "save_gbs": gbs(size, t["save"]),
            "load_gbs": gbs(size, t["load"]),
            "both_gbs": gbs(2 * size, t["both"]),
            # bytes per second both ways at once, over one direction's alone (their mean)
            "ratio": round((t["save"] + t["load"]) / t["both"], 3),
        }

    def end_to_end(self) -> dict[str, Any]:
        """Producer.put until committed and Consumer.get until landed (one round trip each, and
        the Commit's) vs the bare copy of the same bytes by the mover."""
        figures: dict[str, Any] = {}
        for size in (8 * MiB, 64 * MiB):
            figures.update(self._end_to_end(size))
        return figures

    def _end_to_end(self, size: int) -> dict[str, Any]:
        producer, consumer = Producer(self.client, "bench"), Consumer(self.client, "bench")
        label = f"{size // MiB}MiB"
        extent, spec = self.extent(size), TensorSpec((size,), "uint8", size)
        device = torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.device)
        out = torch.empty_like(device)
        key = f"get-{label}"
        producer.put(key, device)
        puts: list[str] = []

        def put() -> None:
            puts.append(f"put-{label}-{len(puts)}")  # older ones are evicted as the pool fills
            producer.put_many_async({puts[-1]: device}).wait()  # landed and committed

        t = side_by_side(
            {
                "put": put,
                "bare_save": lambda: landed(self.mover.save(device, extent)),
                "get": lambda: consumer.get_many_async([key], self.device).wait(),
                "bare_load": lambda: landed(self.mover.load(extent, spec, out)[1]),
            }
        )
        loaded = consumer.get(key, device=self.device)
        self.client.delete("bench", [*puts, key])
        return {
            f"put_{label}_gbs": gbs(size, t["put"]),
            f"put_{label}_vs_bare": round(t["bare_save"] / t["put"], 3),
            f"get_{label}_gbs": gbs(size, t["get"]),
            f"get_{label}_vs_bare": round(t["bare_load"] / t["get"], 3),
            f"get_{label}_bit_identical": loaded is not None and torch.equal(loaded, device),
        }

    def value(self) -> dict[str, Any]:
        """Loading one image's embeddings (rows x 3584, bf16) from the pool onto the GPU vs
        running a ViT-L/14-sized encoder (random weights) on the image those rows come from."""
        figures: dict[str, Any] = {}
        for rows, image in ((256, 224), (1369, 518)):
            figures.update(self._value(rows, image))
            torch.cuda.empty_cache()
        return figures

    def _value(self, rows: int, image: int) -> dict[str, Any]:
        producer, consumer = Producer(self.client, "bench"), Consumer(self.client, "bench")
        key = f"image-{rows}"
        producer.put(key, torch.randn(rows, 3584, device=self.device).to(torch.bfloat16))
        name, encode = vit_large(image, self.device)
        with torch.inference_mode():
            t = side_by_side(
                {"get": lambda: consumer.get(key, device=self.device), "encode": encode}, runs=10
            )
        return {
            f"encoder_{image}px": name,
            f"rows_{rows}_get_ms": round(t["get"] * 1e3, 3),
            f"rows_{rows}_encode_ms": round(t["encode"] * 1e3, 3),
            f"rows_{rows}_encode_over_get": round(t["encode"] / t["get"], 1),
        }


def blocks(nbytes: int) -> int:
    return -(-nbytes // BLOCK)


def scattered(count: int, pieces: int, start: int) -> list[Extent]:
    """`count` blocks in `pieces` extents from block `start`, one free block after each."""
    size, extra = divmod(count, pieces)
    extents, at = [], start
    for i in range(pieces):
        n = size + (1 if i < extra else 0)
        extents.append(Extent(at, n))
        at += n + 1
    return extents


def vit_large(image: int, device: torch.device) -> tuple[str, Callable[[], object]]:
    """A ViT-L/14 (24 layers, width 1024, 16 heads, MLP 4096) with random weights, in bf16 on
    `device`, from transformers' config or else timm's class; and a call that encodes one
    `image` x `image` picture with it."""
    pixels = torch.randn(1, 3, image, image, device=device, dtype=torch.bfloat16)
    patches = f"ViT-L/14, {image} px, {(image // 14) ** 2} patches"
    try:
        from transformers import ViTConfig, ViTModel
    except ImportError:
        from timm.models.vision_transformer import VisionTransformer

        with torch.device(device):
            vit = VisionTransformer(
                img_size=image, patch_size=14, embed_dim=1024, depth=24, num_heads=16, num_classes=0
            )
        vit = vit.to(torch.bfloat16).eval()
        return f"timm VisionTransformer ({patches})", lambda: vit.forward_features(pixels)
    config = ViTConfig(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        image_size=image,
        patch_size=14,
    )
    with torch.device(device):
        model = ViTModel(config, add_pooling_layer=False)
    model = model.to(torch.bfloat16).eval()
    return f"transformers ViTModel ({patches})", lambda: model(pixel_values=pixels)


@contextlib.contextmanager
def section(report: Report, name: str) -> Iterator[dict[str, Any]]:
    """Run one section; its figures, or its error, go into the report either way."""
    figures: dict[str, Any] = {}
    started = time.monotonic()
    try:
        yield figures
    except Exception as error:
        figures["error"] = f"{type(error).__name__}: {error}"
    figures["seconds"] = round(time.monotonic() - started, 1)
    report.add(name, figures)


def targets(report: Report) -> dict[str, Any]:
    results = {}
    for name, figure, least in TARGETS:
        value = report.data["sections"].get(name, {}).get(figure)
        met = None if value is None else value >= least
        results[f"{name}.{figure} >= {least}"] = {"value": value, "met": met}
    return results


def print_table(report: Report) -> None:
    print("\n" + "=" * 78)
    for name, figures in report.data["sections"].items():
        print(f"{name}")
        for key, value in figures.items():
            shown = value if not isinstance(value, dict) else json.dumps(value)
            print(f"    {key:<38} {shown}")
    print("=" * 78)


def benchmark(report: Report, client: Client) -> None:
    try:
        bench = Bench(client)
    except Exception as error:
        report.add("benchmark", {"error": f"{type(error).__name__}: {error}"})
        return
    for name in ("copies", "extents", "concurrent", "end_to_end", "value"):
        with section(report, name) as figures:
            if report.over_budget():
                raise TimeoutError(f"skipped: past the {BUDGET_S:.0f} s budget")
            figures.update(getattr(bench, name)())
    bench.close()


def main() -> int:
    out_dir = Path(os.environ.get("ECD_GPU_OUT") or tempfile.mkdtemp(prefix="ecd-gpu-check-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir / "gpu-check.json")
    print(f"gpu-check: figures go to {report.path}", flush=True)
    require = os.environ.get("ECD_REQUIRE_GPU", "1") == "1"
    cuda = torch.cuda.is_available()
    with pools_with_room(2 * POOL_BYTES) as pool_dir, contextlib.ExitStack() as stack:
        report.add("environment", environment(pool_dir))
        client: Client | None = None
        with section(report, "smoke") as figures:
            args = ("--max-bytes", "2GiB", "--lease-ttl", "10", "--log-level", "warning")
            daemon = stack.enter_context(running_daemon(*args))
            client = stack.enter_context(daemon.client())
            figures.update(smoke(client))
        with section(report, "tests") as figures:
            figures.update(run_tests(out_dir))
        if not cuda:
            report.add("benchmark", {"skipped": "no CUDA device"})
        elif client is not None:
            benchmark(report, client)
    report.data["targets"] = targets(report)
    tests = report.data["sections"]["tests"]
    failed = tests.get("exit_code") != 0 or (require and not cuda)
    report.data["status"] = "failed" if failed else "passed"
    report.add("result", {"status": report.data["status"], "tests": tests.get("summary")})
    print_table(report)
    print(json.dumps(report.data["targets"], indent=2))
    print(f"gpu-check {report.data['status']}: {report.path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
