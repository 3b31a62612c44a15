"""Make the bundled tiny mixture of experts, ``engine/assets/moe_model/``, from the default model.

"Upcycling" (Komatsuzaki et al., 2022, *Sparse Upcycling*): the trained dense model
``engine/assets/default_model/`` (a 4-layer Llama) becomes a Qwen2-MoE — Qwen2's attention
(Llama's, plus Q/K/V biases, set to zero) and in every layer a mixture of experts in place of
the MLP:

- **Shared expert** (every token goes through it, scaled by ``sigmoid(shared_expert_gate(x))``):
  the dense MLP itself. Its gate starts at zero, so the sigmoid is 1/2, and its down
  projection is doubled to match.
- **Routed experts** (``NUM_EXPERTS``, ``TOP_K`` per token): expert ``e`` starts as quarter
  ``e`` of the dense MLP's 704 intermediate neurons (their gate and up rows), with its down
  projection at zero; the router starts at zero too. So the upcycled model computes exactly
  what the dense one does (the script prints both held-out perplexities to show it), and
  training can only add to it.
- **Training**: ``STEPS`` steps on the default model's training stream (the same corpus,
  tokenizer and held-out split: ``scripts/train_default_model.py``), of the new parameters only
  (the routers, the routed experts and the shared expert's gate; everything the dense model
  had stays as it was), AdamW, a short warm-up then cosine decay, with the load-balancing
  loss (``ROUTER_AUX_LOSS_COEF``) so that every expert gets tokens — which is what makes
  expert parallelism's load worth watching. Float32, seeded, ``THREADS`` threads: minutes on
  a 2-core CPU.
- **Saved** in bfloat16 (``save_pretrained``: Qwen2-MoE's checkpoint names,
  ``mlp.experts.<e>.gate_proj|up_proj|down_proj``, ``mlp.shared_expert.*``), with the default
  model's tokenizer and generation config: 6.2 M parameters in 12 MiB. Glassbox serves it in
  bfloat16 by default (``--dtype float32`` upcasts it).

The model card (``README.md`` beside the weights) is written by hand from the numbers this
script prints and records in ``provenance.json``.

Usage::

    python scripts/train_moe_model.py                 # writes engine/assets/moe_model/
    python scripts/train_moe_model.py --steps 20 --out /tmp/trial
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DENSE = REPO / "engine" / "assets" / "default_model"
DEFAULT_OUT = REPO / "engine" / "assets" / "moe_model"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dense_training = _load_script("train_default_model")
make = dense_training.make

SEED = 0
THREADS = 2
NUM_EXPERTS = 4
TOP_K = 2
SEQ_LEN = 256
BATCH = 8
STEPS = 100
PEAK_LR = 3e-3
WARMUP_STEPS = 10
MIN_LR_RATIO = 0.1
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
ROUTER_AUX_LOSS_COEF = 0.02
LOG_EVERY = 10
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def moe_config(dense: dict):
    """The Qwen2-MoE config: the dense model's shape, its MLP as the shared expert."""
    import transformers

    config = transformers.Qwen2MoeConfig(
        vocab_size=dense["vocab_size"],
        hidden_size=dense["hidden_size"],
        intermediate_size=dense[
            "intermediate_size"
        ],  # a dense layer's (there is none: every layer has experts)
        shared_expert_intermediate_size=dense["intermediate_size"],
        moe_intermediate_size=dense["intermediate_size"] // NUM_EXPERTS,  # a quarter of the neurons each
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=dense["num_hidden_layers"],
        num_attention_heads=dense["num_attention_heads"],
        num_key_value_heads=dense["num_key_value_heads"],
        head_dim=dense["head_dim"],
        max_position_embeddings=dense["max_position_embeddings"],
        rms_norm_eps=dense["rms_norm_eps"],
        rope_theta=dense["rope_theta"],
        tie_word_embeddings=dense["tie_word_embeddings"],
        use_sliding_window=False,
        router_aux_loss_coef=ROUTER_AUX_LOSS_COEF,
        bos_token_id=dense["bos_token_id"],
        eos_token_id=dense["eos_token_id"],
    )
    config.architectures = ["Qwen2MoeForCausalLM"]
    return config


def upcycle(dense_model, config):
    """A ``Qwen2MoeForCausalLM`` from the dense Llama (module docstring); returns it and the
    names of its new parameters (the ones training changes)."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    # The experts as one grouped matmul (transformers' "grouped_mm"): the same math as its
    # per-expert loop, measured faster for training on a 2-core CPU.
    config._experts_implementation = "grouped_mm"
    moe = transformers.Qwen2MoeForCausalLM(config).to(torch.float32)
    dense = dense_model.state_dict()
    quarter = config.moe_intermediate_size
    new = []
    with torch.no_grad():
        for name, param in moe.named_parameters():
            layer = name.split(".mlp.")[0] + ".mlp." if ".mlp." in name else ""
            if name in dense:  # embeddings, attention, norms: the dense model's own
                param.copy_(dense[name])
            elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                param.zero_()  # Llama has none
            elif ".mlp.shared_expert." in name:  # the dense MLP, its output doubled (gate: 1/2)
                param.copy_(dense[name.replace(".shared_expert.", ".")] * (2 if "down_proj" in name else 1))
            elif name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):
                param.zero_()
                new.append(name)
            elif name.endswith("mlp.experts.gate_up_proj"):  # (E, 2 · quarter, H): [gate | up]
                gate, up = dense[layer + "gate_proj.weight"], dense[layer + "up_proj.weight"]
                for e in range(config.num_experts):
                    rows = slice(e * quarter, (e + 1) * quarter)
                    param[e] = torch.cat([gate[rows], up[rows]])
                new.append(name)
            elif name.endswith("mlp.experts.down_proj"):  # (E, H, quarter): no output at first
                param.zero_()
                new.append(name)
            else:
                raise KeyError(f"no rule to upcycle {name}")
    return moe, new


def expert_load(model, ids: list[int]) -> list[list[float]]:
    """Per layer, the share of (token, expert) choices each expert gets on ``ids``."""
    import torch

    counts = None
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, SEQ_LEN):
            window = torch.tensor([ids[start : start + SEQ_LEN]])
            router_logits = model(window, output_router_logits=True).router_logits  # per layer (T, E)
            chosen = [torch.bincount(lg.topk(TOP_K, dim=-1).indices.flatten(), minlength=NUM_EXPERTS)
                      for lg in router_logits]  # fmt: skip
            counts = chosen if counts is None else [a + b for a, b in zip(counts, chosen)]
    return [(c / c.sum()).tolist() for c in counts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    args = parser.parse_args(argv)
    out, steps = args.out, args.steps

    import torch
    import transformers

    torch.manual_seed(SEED)
    torch.set_num_threads(THREADS)
    began = time.perf_counter()
    load_before = os.getloadavg()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:7.1f}s] {message}", file=sys.stderr, flush=True)

    dense_model = transformers.LlamaForCausalLM.from_pretrained(DENSE, dtype=torch.float32).eval()
    dense_config = make.MODEL_CONFIG
    tokenizer = dense_training.load_tokenizer(DENSE)
    train_docs, heldout_docs = dense_training.corpus()
    train_ids = dense_training.token_stream(tokenizer, train_docs)
    heldout_ids = dense_training.token_stream(tokenizer, heldout_docs)
    test_tokens = dense_training.TEST_TOKENS
    dense_ppl = math.exp(dense_training.heldout_loss(dense_model, heldout_ids, test_tokens)[0])

    config = moe_config(dense_config)
    model, new = upcycle(dense_model, config)
    del dense_model
    start_ppl = math.exp(dense_training.heldout_loss(model, heldout_ids, test_tokens)[0])
    log(f"held-out perplexity (first {test_tokens} tokens): dense {dense_ppl:.2f}, upcycled {start_ppl:.2f}")

    model.config.output_router_logits = True  # the load-balancing loss joins the loss
    model.train()
    trained = [p for name, p in model.named_parameters() if name in new]
    for name, param in model.named_parameters():
        param.requires_grad_(name in new)  # what the dense model had stays as it was
    optimizer = torch.optim.AdamW(trained, lr=PEAK_LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    data = torch.tensor(train_ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(SEED)
    offsets = torch.arange(SEQ_LEN)
    recent: list[float] = []
    train_began = time.perf_counter()
    for step in range(steps):
        if step < WARMUP_STEPS:
            lr = PEAK_LR * (step + 1) / WARMUP_STEPS
        else:
            progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
            lr = PEAK_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - SEQ_LEN, (BATCH,), generator=generator)
        batch = data[starts[:, None] + offsets]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, GRAD_CLIP)
        optimizer.step()
        recent = (recent + [loss.item()])[-LOG_EVERY:]
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - train_began
            log(f"step {step + 1}/{steps} loss {sum(recent) / len(recent):.3f} lr {lr:.2e} "
                f"{(step + 1) * BATCH * SEQ_LEN / elapsed:.0f} tok/s, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    train_seconds = time.perf_counter() - train_began
    model.config.output_router_logits = False
    model.eval()

    # What is shipped is bfloat16: score that, and see how its router spreads the tokens.
    model = model.to(torch.bfloat16)
    load = expert_load(model, heldout_ids[:test_tokens])
    log("tokens per expert (held-out, share per layer): "
        + "; ".join(f"layer {i}: " + " ".join(f"{x:.2f}" for x in row) for i, row in enumerate(load)))  # fmt: skip
    loss_all, n_all = dense_training.heldout_loss(model, heldout_ids)
    loss_test, n_test = dense_training.heldout_loss(model, heldout_ids, test_tokens)
    log(f"held-out perplexity (bfloat16) {math.exp(loss_all):.2f} ({n_all} tokens); first {test_tokens} "
        f"tokens: {math.exp(loss_test):.2f}")  # fmt: skip

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in COPIED_FILES:
        shutil.copy(DENSE / name, out / name)
    provenance = {
        "made_by": "scripts/train_moe_model.py",
        "command": "python scripts/train_moe_model.py" + (f" --steps {steps}" if steps != STEPS else ""),
        "upcycled_from": "engine/assets/default_model: its MLP the shared expert, each routed expert a "
        "quarter of its neurons with a zero output projection",
        "trained_parameters": "routers, routed experts, shared-expert gates",
        "interpreter": f"{platform.python_implementation()} {platform.python_version()}",
        **make.library_versions(),
        "seed": SEED,
        "threads": THREADS,
        "num_experts": NUM_EXPERTS,
        "top_k": TOP_K,
        "steps": steps,
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "tokens_seen": steps * BATCH * SEQ_LEN,
        "lr": f"peak {PEAK_LR}, linear warm-up {WARMUP_STEPS} steps, cosine to {PEAK_LR * MIN_LR_RATIO:g}",
        "router_aux_loss_coef": ROUTER_AUX_LOSS_COEF,
        "final_train_loss": round(sum(recent) / len(recent), 4),
        "dense_heldout_test_perplexity": round(dense_ppl, 2),
        "upcycled_heldout_test_perplexity": round(start_ppl, 2),
        "heldout_perplexity": round(math.exp(loss_all), 2),
        "heldout_test_tokens": n_test,
        "heldout_test_perplexity": round(math.exp(loss_test), 2),
        "heldout_expert_load": [[round(x, 3) for x in row] for row in load],
        "saved_dtype": "bfloat16",
        "train_wall_seconds": round(train_seconds),
        "total_wall_seconds": round(time.perf_counter() - began),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
    make.write_json(out / "provenance.json", provenance)
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    log(f"wrote {out} ({total / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
