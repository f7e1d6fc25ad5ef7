"""The serving benchmark's request stream (`make bench-serve`, serve_bench.py): one image per
request, drawn from a catalog of images by a Zipf law, so that a few images come back often and
most rarely (as product pictures, the turns of a chat and shared pictures do), written as the
JSONL file of vLLM's `CustomImageDataset` (`vllm bench serve --dataset-name custom_image`).

The stream is fixed by its parameters (a seed): every configuration the benchmark compares is
sent the same requests in the same order. Its reuse, the share of requests whose image an
earlier request of the stream already sent, is what a cache can save at most; `catalog_for`
picks the catalog's size that gives a target reuse.

Each request's text names the request: no two prompts are the same. The chat template puts the
image first (after "USER: "), so in one engine vLLM's prefix cache serves a repeat's image
tokens up to the image's last KV block, which holds the request's own text too: never the whole
image, so every repeat still needs its encoder output, from vLLM's own encoder cache in that
engine or from a connector.

vLLM's own encoder cache in an engine holds a few images (serve_bench.py says how many for its
servers) and evicts the one released longest ago; `in_engine_hits` says how many of a stream's
repeats such a cache serves, so a stream can be sized to leave a connector most repeats to save.
"""

from __future__ import annotations

import base64
import io
import json
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from e2e_engine import image

FIRST_IMAGE = 1000  # the catalog's images are e2e_engine.image(FIRST_IMAGE + rank)


DEFAULT_REQUESTS = 48  # serve_bench.py's docstring says why


@dataclass(frozen=True)
class Stream:
    requests: int
    catalog: int  # images to draw from
    zipf: float = 1.0  # the exponent: rank k is drawn with weight 1 / k**zipf
    seed: int = 0

    def images(self) -> list[int]:
        """Each request's image, as its rank in the catalog (0 the most often drawn)."""
        weights = [1 / (rank + 1) ** self.zipf for rank in range(self.catalog)]
        return random.Random(self.seed).choices(range(self.catalog), weights, k=self.requests)

    def reuse(self) -> float:
        """The share of requests whose image an earlier request sent."""
        images = self.images()
        return 1 - len(set(images)) / len(images)

    def in_engine_hits(self, capacity: int) -> int:
        """The repeats an engine's own encoder cache of `capacity` images serves when the
        requests come one at a time: vLLM's EncoderCacheManager keeps a released image until
        room is needed and then evicts the one released longest ago (with requests in flight
        together, an image they hold is not evicted, so the count moves a little)."""
        held: OrderedDict[int, None] = OrderedDict()
        hits = 0
        for rank in self.images():
            if rank in held:
                hits += 1
                held.move_to_end(rank)
                continue
            held[rank] = None
            if len(held) > capacity:
                held.popitem(last=False)
        return hits

    def write(self, path: Path) -> None:
        """The stream as `CustomImageDataset`'s JSONL (`prompt`, `image_files`), one line per
        request in order (the benchmark runs it with --disable-shuffle), each image a base64
        PNG data URL: the client sends the bytes, as an application does."""
        urls = {rank: data_url(FIRST_IMAGE + rank) for rank in set(self.images())}
        with path.open("w") as out:
            for number, rank in enumerate(self.images()):
                prompt = f"Request {number}: what is in this picture?"
                out.write(json.dumps({"prompt": prompt, "image_files": [urls[rank]]}) + "\n")


def catalog_for(requests: int, reuse: float, zipf: float = 1.0, seed: int = 0) -> Stream:
    """The stream of `requests` whose reuse comes closest to `reuse` (the smallest catalog on
    a tie)."""
    streams = [Stream(requests, catalog, zipf, seed) for catalog in range(1, requests + 1)]
    return min(streams, key=lambda stream: abs(stream.reuse() - reuse))


def data_url(seed: int) -> str:
    png = io.BytesIO()
    image(seed).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
