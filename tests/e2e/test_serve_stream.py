"""The serving benchmark's request stream (serve_stream.py): the reuse it states is the reuse it
has, and vLLM's own benchmark dataset reads it as written, in order."""

from __future__ import annotations

from collections import Counter
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
