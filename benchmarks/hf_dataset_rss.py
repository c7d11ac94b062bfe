"""Peak memory of HFDatasetProcessor tokenizing (and packing) a large jsonl file.

Writes ``--gb`` GB of prompt-completion jsonl (default 1) into a temporary folder,
with a small byte-level BPE tokenizer built here, then builds the processor's loader
(tokenizing into the Arrow cache, then packing) and reads a few batches. Prints
the process's peak RSS above its RSS at the start (target: below 1 GB for 1 GB of
jsonl, Note [hf dataset cache] in weightstream/data/hf_dataset/build.py), and the time taken.

    python benchmarks/hf_dataset_rss.py --gb 0.2 [--packing false] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import threading
import time
from pathlib import Path

WORDS = (
    "the of and to in is for that on with as was by at from it an be this are or which "
    "model data weight stream layer memory token batch step loss train eval device host"
).split()


def rss_bytes() -> int:
    """The process's resident set now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """The kernel's peak resident set (VmHWM): anonymous memory and mapped file pages. Not
    getrusage's ru_maxrss, which keeps the forked parent's size across exec."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def rss_parts() -> dict[str, int]:
    """Resident anonymous memory (RssAnon: the process's own) and resident pages of mapped
    files (RssFile: page cache, reclaimable whenever memory is short), bytes."""
    out = {"RssAnon": 0, "RssFile": 0}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in out:
                out[key] = int(line.split()[1]) * 1024
    return out


class RssPeaks:
    """The peaks of :func:`rss_parts`, sampled every 20 ms on a thread.

    Why: the kernel keeps a peak of the whole resident set only (VmHWM), which counts
    the pages of the memory-mapped Arrow files read as well as the process's own memory;
    the two peaks say which of them grew.
    Owner: main(), for the processor's build and the batches read.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.peak = rss_parts()
        self.when = dict.fromkeys(self.peak, 0.0)  # seconds after start of each peak
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        now = rss_parts()
        for key, value in now.items():
            if value > self.peak[key]:
                self.peak[key], self.when[key] = value, time.perf_counter() - self.start

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def __enter__(self) -> RssPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def write_jsonl(path: Path, size: int, seed: int = 0) -> int:
    """About ``size`` bytes of prompt-completion lines; returns the number of lines."""
    rng = random.Random(seed)
    lines, written = 0, 0
    with open(path, "w") as f:
        while written < size:
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(20, 200)))
            completion = " " + " ".join(rng.choices(WORDS, k=rng.randint(20, 400)))
            line = json.dumps({"prompt": prompt, "completion": completion}) + "\n"
            f.write(line)
            written += len(line)
            lines += 1
    return lines


def make_tokenizer(folder: Path) -> Path:
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(WORDS)] * 50, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="jsonl size in GB (1e9 bytes)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--packing", choices=("true", "false"), default="true")
    parser.add_argument("--keep", help="work in this folder (kept) instead of a temporary one")
    args = parser.parse_args()
    start_rss = rss_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        data = root / "data.jsonl"
        t0 = time.perf_counter()
        lines = write_jsonl(data, int(args.gb * 1e9))
        t_write = time.perf_counter() - t0
        tokenizer = make_tokenizer(root / "tokenizer")
        from weightstream.data.processors import get_data_processor

        base_rss, base = rss_bytes(), rss_parts()  # libraries imported
        section = {
            "data_processor": "HFDatasetProcessor",
            "data_dir": str(data),
            "tokenizer": str(tokenizer),
            "batch_size": 8,
            "seq_len": args.seq_len,
            "packing": args.packing == "true",
            "cache_dir": str(root / "cache"),
        }
        with RssPeaks() as peaks:
            t0 = time.perf_counter()
            loader = get_data_processor("HFDatasetProcessor")(section, True)
            t_build = time.perf_counter() - t0
            built = {**rss_parts(), "peak": peak_rss_bytes()}  # before any batch is read
            for i, _batch in enumerate(loader):
                if i == 20:
                    break
            t0 = time.perf_counter()
            get_data_processor("HFDatasetProcessor")(section, True)  # a second build: cached
            t_rebuild = time.perf_counter() - t0
        peak = peak_rss_bytes()
        print(
            f"jsonl: {data.stat().st_size / 1e9:.3f} GB, {lines} lines (written in {t_write:.1f} s)"
        )
        print(f"rows: {len(loader.dataset)} of {args.seq_len} tokens (packing {args.packing})")
        print(
            f"build: {t_build:.1f} s (tokenize + rows); second build from the cache: {t_rebuild:.2f} s"
        )
        print(
            f"RSS at start {start_rss / 1e6:.0f} MB, after imports {base_rss / 1e6:.0f} MB, "
            f"peak {peak / 1e6:.0f} MB"
        )
        print(f"peak RSS above the process start: {(peak - start_rss) / 1e9:.3f} GB")
        print(
            f"  of which the build (before a batch is read): peak {(built['peak'] - start_rss) / 1e9:.3f} GB "
            f"above the start; when done, RssAnon {(built['RssAnon'] - base['RssAnon']) / 1e9:.3f} GB "
            f"and RssFile {(built['RssFile'] - base['RssFile']) / 1e9:.3f} GB above the imports"
        )
        print(f"peak RSS above the imports: {(peak - base_rss) / 1e9:.3f} GB")
        for key, what in (("RssAnon", "anonymous"), ("RssFile", "mapped file pages")):
            print(
                f"peak {key} ({what}, sampled every 20 ms): {peaks.peak[key] / 1e9:.3f} GB, "
                f"{(peaks.peak[key] - base[key]) / 1e9:.3f} GB above the imports, "
                f"{peaks.when[key]:.1f} s after the build started"
            )


if __name__ == "__main__":
    main()
