"""Train the bundled default model in ``engine/assets/default_model/`` on the CPU.

``scripts/make_default_model.py`` makes the tokenizer, the config files and the initial
(random) weights; this script imports it, trains those weights and writes the shipped
directory: the tokenizer and config files (byte-identical to what the make script writes),
the trained ``model.safetensors`` (float32) and ``provenance.json``. The model card
(``README.md``) is written by hand from the numbers this script prints and records.

The corpus is text every Python install already has, under the PSF licence:

- the docstrings of the standard library's modules (module, class and function docstrings in
  source order; the make script's own corpus functions): the top-level ``<stdlib>/*.py``
  (the tokenizer's training corpus) then the packages' ``*.py`` (sorted by path), leaving out
  tests, ``idlelib``, ``lib2to3``, ``turtledemo``, the generated ``encodings`` codecs and
  ``site-packages``;
- the language-reference topics that ``pydoc`` shows (``pydoc_data.topics``, sorted by key).

Every docstring or topic is one document; documents are joined with ``<|endoftext|>`` (id 0,
the EOS token) so the model learns to end a passage. Every ``HOLDOUT_EVERY``-th module file
(by position in the file list) and every ``HOLDOUT_EVERY``-th topic is held out whole, for
the held-out perplexity; the rest is the training stream.

Training (all seeded, so a rerun with the same Python, torch and thread count gives the same
weights): ``STEPS`` steps of ``BATCH`` windows of ``SEQ_LEN`` tokens at random offsets in the
training stream (drawn from one ``torch.Generator``), AdamW (β = 0.9, 0.95, weight decay 0.1
on matrices only), linear warm-up then cosine decay to a tenth of the peak learning rate,
gradient clipping at 1.0, float32, ``torch.set_num_threads(THREADS)``. The step count is fixed
(not a time budget) and sized so a quiet 2-core machine finishes in about 15 minutes (under 30).

Held-out perplexity is exp(mean next-token cross-entropy) over non-overlapping ``SEQ_LEN``
windows of the held-out stream; ``provenance.json`` records it for the whole held-out stream
and for its first ``TEST_TOKENS`` tokens (what ``tests/unit/model/test_default_model.py`` recomputes).

Usage::

    python scripts/train_default_model.py                  # writes engine/assets/default_model/
    python scripts/train_default_model.py --out DIR        # somewhere else
    python scripts/train_default_model.py --steps 20 --out /tmp/trial   # a quick trial
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "engine" / "assets" / "default_model"


def _load_make_script():
    spec = importlib.util.spec_from_file_location(
        "make_default_model", Path(__file__).parent / "make_default_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make = _load_make_script()

SEED = 0
THREADS = 2
SEQ_LEN = 256
BATCH = 16
STEPS = 1200
PEAK_LR = 3e-3
MIN_LR_RATIO = 0.1
WARMUP_STEPS = 100
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
LOG_EVERY = 25
EVAL_EVERY = 200  # log the held-out test slice's perplexity too
HOLDOUT_EVERY = 20
TEST_TOKENS = 4096  # the held-out slice the test recomputes (16 windows of SEQ_LEN)

# Package directories left out of the corpus: tests, the IDE, 2to3, demos, generated codecs.
EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "encodings", "site-packages"}


def package_files() -> list[Path]:
    """The standard library packages' ``*.py`` files, sorted by path (exclusions above)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.glob("*/**/*.py") if not EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def corpus() -> tuple[list[str], list[str]]:
    """``(train, heldout)`` documents: docstrings per module file, then pydoc topics."""
    import pydoc_data.topics

    train: list[str] = []
    heldout: list[str] = []
    files = make.stdlib_corpus_files() + package_files()
    for i, path in enumerate(files):
        (heldout if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else train).extend(make.stdlib_docstrings([path]))
    topics = pydoc_data.topics.topics
    for i, key in enumerate(sorted(topics)):
        (heldout if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else train).append(topics[key].strip())
    return train, heldout


def token_stream(tokenizer, docs: list[str]) -> list[int]:
    """The documents' token ids, each followed by ``<|endoftext|>`` (id 0)."""
    eos = tokenizer.token_to_id(make.ENDOFTEXT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(docs):
        ids += encoding.ids
        ids.append(eos)
    return ids


def load_tokenizer(model_dir: Path = DEFAULT_OUT):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def heldout_loss(model, ids: list[int], max_tokens: int | None = None) -> tuple[float, int]:
    """Mean next-token cross-entropy over non-overlapping ``SEQ_LEN`` windows; (loss, tokens)."""
    import torch

    if max_tokens is not None:
        ids = ids[:max_tokens]
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, SEQ_LEN):
            window = torch.tensor([ids[start : start + SEQ_LEN + 1]])
            if window.shape[1] < 2:
                break
            logits = model(window[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum")
            total += loss.item()
            count += window.shape[1] - 1
    model.train(was_training)
    return total / count, count


def learning_rate(step: int, steps: int) -> float:
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return PEAK_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def sha256(docs: list[str]) -> str:
    return hashlib.sha256("\n\n".join(docs).encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    args = parser.parse_args(argv)
    out: Path = args.out
    steps: int = args.steps

    import torch

    torch.manual_seed(SEED)
    torch.set_num_threads(THREADS)
    began = time.perf_counter()
    load_before = os.getloadavg()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:7.1f}s] {message}", file=sys.stderr, flush=True)

    provenance = make.write_tokenizer(out)  # byte-identical tokenizer files
    make.write_configs(out)
    tokenizer = load_tokenizer(out)
    train_docs, heldout_docs = corpus()
    train_ids, heldout_ids = token_stream(tokenizer, train_docs), token_stream(tokenizer, heldout_docs)
    log(
        f"corpus: {len(train_docs)} training documents ({len(train_ids)} tokens), "
        f"{len(heldout_docs)} held out ({len(heldout_ids)} tokens)"
    )
    data = torch.tensor(train_ids, dtype=torch.long)

    model = make.initial_model()
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=BETAS,
    )
    generator = torch.Generator().manual_seed(SEED)
    offsets = torch.arange(SEQ_LEN)
    recent: list[float] = []
    train_began = time.perf_counter()
    for step in range(steps):
        lr = learning_rate(step, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - SEQ_LEN, (BATCH,), generator=generator)
        batch = data[starts[:, None] + offsets]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        recent = (recent + [loss.item()])[-LOG_EVERY:]
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - train_began
            rate = (step + 1) * BATCH * SEQ_LEN / elapsed
            eta = (steps - step - 1) * elapsed / (step + 1)
            log(
                f"step {step + 1}/{steps} loss {sum(recent) / len(recent):.3f} lr {lr:.2e} "
                f"{rate:.0f} tok/s, ~{eta / 60:.1f} min left, load {os.getloadavg()[0]:.2f}"
            )
        if (step + 1) % EVAL_EVERY == 0:
            log(
                f"held-out perplexity (first {TEST_TOKENS} tokens) {math.exp(heldout_loss(model, heldout_ids, TEST_TOKENS)[0]):.2f}"
            )
    train_seconds = time.perf_counter() - train_began
    final_train_loss = sum(recent) / len(recent)

    loss_all, n_all = heldout_loss(model, heldout_ids)
    loss_test, n_test = heldout_loss(model, heldout_ids, TEST_TOKENS)
    log(
        f"held-out loss {loss_all:.4f}, perplexity {math.exp(loss_all):.2f} ({n_all} tokens); "
        f"first {TEST_TOKENS} tokens ({n_test} predictions): perplexity {math.exp(loss_test):.2f}"
    )
    make.save_model(model, out)

    import transformers

    provenance.update(
        seed=SEED,
        weights="trained by scripts/train_default_model.py",
        **make.library_versions(),
        training={
            "script": "scripts/train_default_model.py",
            "command": "python scripts/train_default_model.py"
            + (f" --steps {steps}" if steps != STEPS else ""),
            "interpreter": f"{platform.python_implementation()} {platform.python_version()}",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "corpus": (
                "docstrings of <stdlib>/*.py then <stdlib>/<package>/**/*.py (sorted by path; "
                f"excluding {', '.join(sorted(EXCLUDED_DIRS))}), then pydoc_data.topics (sorted by key); "
                "one document per docstring or topic, each followed by <|endoftext|>; every "
                f"{HOLDOUT_EVERY}th file and topic held out"
            ),
            "corpus_files": len(make.stdlib_corpus_files()) + len(package_files()),
            "train_documents": len(train_docs),
            "train_tokens": len(train_ids),
            "train_sha256": sha256(train_docs),
            "heldout_documents": len(heldout_docs),
            "heldout_tokens": len(heldout_ids),
            "heldout_sha256": sha256(heldout_docs),
            "seed": SEED,
            "threads": THREADS,
            "steps": steps,
            "batch": BATCH,
            "seq_len": SEQ_LEN,
            "tokens_seen": steps * BATCH * SEQ_LEN,
            "epochs": round(steps * BATCH * SEQ_LEN / len(train_ids), 2),
            "optimizer": f"AdamW betas {list(BETAS)}, weight decay {WEIGHT_DECAY} (matrices), grad clip {GRAD_CLIP}",
            "lr": f"peak {PEAK_LR}, linear warm-up {WARMUP_STEPS} steps, cosine to {PEAK_LR * MIN_LR_RATIO:g}",
            "final_train_loss": round(final_train_loss, 4),
            "heldout_loss": round(loss_all, 4),
            "heldout_perplexity": round(math.exp(loss_all), 2),
            "heldout_test_tokens": n_test,
            "heldout_test_perplexity": round(math.exp(loss_test), 2),
            "train_wall_seconds": round(train_seconds),
            "total_wall_seconds": round(time.perf_counter() - began),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        },
    )
    make.write_json(out / "provenance.json", provenance)
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    log(f"wrote {out} ({total / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
