"""The serving benchmark's request stream (serve_stream.py): the reuse it states is the reuse it
has, what an engine's own encoder cache would serve of it, and vLLM's own benchmark dataset reads
it as written, in order."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from pathlib import Path

from serve_stream import Stream, catalog_for


def test_a_stream_picked_for_half_reuse_repeats_half_its_requests_images() -> None:
    stream = catalog_for(requests=48, reuse=0.5)
    images = stream.images()

    repeats = sum(1 for n, image in enumerate(images) if image in images[:n])
    assert repeats == round(0.5 * 48)
    assert stream.reuse() == repeats / 48


def test_the_most_popular_image_is_the_catalogs_first() -> None:
    images = Stream(requests=400, catalog=20).images()

    counts = Counter(images)
    assert counts.most_common(1)[0][0] == 0
    assert counts[0] > 2 * counts[19]


def test_an_engine_cache_that_holds_the_whole_catalog_serves_every_repeat() -> None:
    stream = Stream(requests=40, catalog=6)
    images = stream.images()

    assert stream.in_engine_hits(capacity=6) == len(images) - len(set(images))


def test_an_engine_cache_of_one_image_serves_only_a_repeat_of_the_request_before() -> None:
    stream = Stream(requests=40, catalog=4)
    images = stream.images()

    back_to_back = sum(1 for before, now in pairwise(images) if now == before)
    assert stream.in_engine_hits(capacity=1) == back_to_back


def test_an_engine_cache_evicts_the_image_released_longest_ago() -> None:
    class Chosen(Stream):
        def images(self) -> list[int]:
            return [0, 1, 0, 2, 0, 1]

    # Image 2 evicts 1 (released before 0's repeat), not 0 (cached first): both later 0s hit.
    assert Chosen(requests=6, catalog=3).in_engine_hits(capacity=2) == 2


def test_the_benchmarks_default_stream_leaves_most_repeats_past_an_engines_own_cache() -> None:
    from serve_bench import DEFAULT_REQUESTS, IMAGE_TOKENS

    # An OpenAI server on CPU: max_num_batched_tokens 2048 by default, the encoder cache's size
    # (vllm/engine/arg_utils.py get_batch_defaults; the benchmark's table reports each server's).
    capacity = 2048 // IMAGE_TOKENS
    stream = catalog_for(DEFAULT_REQUESTS, reuse=0.5)
    repeats = stream.requests - len(set(stream.images()))

    assert repeats == DEFAULT_REQUESTS // 2
    assert stream.catalog >= 4 * capacity
    assert stream.in_engine_hits(capacity) < repeats / 3


def test_vllms_custom_image_dataset_reads_the_stream_in_order(tmp_path: Path) -> None:
    from vllm.benchmarks.datasets import CustomImageDataset

    stream = Stream(requests=12, catalog=5)
    path = tmp_path / "stream.jsonl"
    stream.write(path)

    dataset = CustomImageDataset(dataset_path=str(path), disable_shuffle=True, random_seed=0)
    requests = dataset.sample(tokenizer=None, num_requests=12, output_len=4)

    sent = [request.multi_modal_data["image_url"]["url"] for request in requests]
    assert [request.prompt for request in requests] == [
        f"Request {n}: what is in this picture?" for n in range(12)
    ]
    # The same image is the same bytes each time it comes back, and no two images are.
    by_image: dict[int, set[str]] = {}
    for image, url in zip(stream.images(), sent, strict=True):
        by_image.setdefault(image, set()).add(url)
    assert all(len(urls) == 1 for urls in by_image.values())
    assert len(set(sent)) == len(by_image)
