"""``python -m bench --compression``: what lossless codecs do to a real training state, per leaf
kind (issue 34's measurement before the choice: docs/benchmarks.md, "Compression").

A small decoder-only transformer (pure JAX, causal attention, pre-norm MLP blocks) is trained with
optax's AdamW for ``--steps`` steps on token sequences drawn from a fixed random bigram chain (so
that the loss falls and the weights move as in training), and a second one is left at its random
initialisation. Each leaf is stored as a checkpoint holds it: params in bfloat16 (and float32),
the AdamW moments in float32. For every leaf kind and codec (the Zarr v3 codecs stock zarr-python
and TensorStore read: ``zstd``, and ``blosc`` with zstd or lz4 behind a byte or bit shuffle), it
prints the ratio (raw bytes / stored bytes), encode and decode speed on one core (GB/s of raw
bytes; Blosc held to one thread), and the link below which the codec saves time on one core
(``pays below``: a raw byte costs 1/link to send, a compressed one 1/encode + 1/(ratio * link), so
it pays where link < encode * (1 - 1/ratio)). Every decode is compared with its input.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

# (name, numcodecs factory): the chains a Zarr v3 array records as codecs after "bytes".
CODECS = {
    "zstd-1": lambda nc: nc.Zstd(level=1),
    "zstd-3": lambda nc: nc.Zstd(level=3),
    "blosc-zstd1-shuffle": lambda nc: nc.Blosc(cname="zstd", clevel=1, shuffle=nc.Blosc.SHUFFLE),
    "blosc-zstd1-bitshuffle": lambda nc: nc.Blosc(cname="zstd", clevel=1, shuffle=nc.Blosc.BITSHUFFLE),
    "blosc-lz4-shuffle": lambda nc: nc.Blosc(cname="lz4", clevel=5, shuffle=nc.Blosc.SHUFFLE),
    "blosc-lz4-bitshuffle": lambda nc: nc.Blosc(cname="lz4", clevel=5, shuffle=nc.Blosc.BITSHUFFLE),
}
CHUNK_BYTES = 4 << 20  # leaves are cut into chunks of at most this many bytes, as a save cuts them
MIN_TIMED_S = 0.2  # each encode / decode is repeated until it has run this long


# ---- the model and its training -----------------------------------------------------------------

def _init(key, vocab: int, dim: int, layers: int) -> dict:
    import jax

    keys = iter(jax.random.split(key, 2 + 6 * layers))

    def dense(shape):
        return jax.random.normal(next(keys), shape) * 0.02

    params: dict[str, Any] = {"embed": dense((vocab, dim)), "final_norm": np.ones(dim, np.float32)}
    for i in range(layers):
        params[f"layer_{i}"] = {
            "attn_norm": np.ones(dim, np.float32), "mlp_norm": np.ones(dim, np.float32),
            "wq": dense((dim, dim)), "wk": dense((dim, dim)), "wv": dense((dim, dim)), "wo": dense((dim, dim)),
            "w_up": dense((dim, 4 * dim)), "w_down": dense((4 * dim, dim)),
        }
    return params


def _loss(params: dict, tokens, heads: int):
    import jax
    import jax.numpy as jnp

    def norm(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale

    x = params["embed"][tokens[:, :-1]]
    b, t, d = x.shape
    mask = jnp.tril(jnp.ones((t, t), bool))
    for i in range(sum(k.startswith("layer_") for k in params)):
        p = params[f"layer_{i}"]
        h = norm(x, p["attn_norm"])
        q, k, v = (jnp.reshape(h @ p[w], (b, t, heads, d // heads)) for w in ("wq", "wk", "wv"))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // heads)
        att = jax.nn.softmax(jnp.where(mask, scores, -1e9), -1)
        x = x + jnp.reshape(jnp.einsum("bhts,bshd->bthd", att, v), (b, t, d)) @ p["wo"]
        x = x + jax.nn.gelu(norm(x, p["mlp_norm"]) @ p["w_up"]) @ p["w_down"]
    logits = norm(x, params["final_norm"]) @ params["embed"].T
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))


def train(steps: int, *, vocab: int = 1024, dim: int = 128, layers: int = 4, heads: int = 4, batch: int = 16,
          seq: int = 64, seed: int = 0) -> tuple[dict, dict, list[float]]:
    """(params, AdamW state {"mu", "nu"}, losses) after `steps` steps (0: the random init)."""
    import jax
    import optax

    rng = np.random.default_rng(seed)
    # A bigram chain: each token's successors are 8 of the vocabulary (learnable structure).
    successors = rng.integers(0, vocab, (vocab, 8))
    params = _init(jax.random.PRNGKey(seed), vocab, dim, layers)
    opt = optax.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)

    @jax.jit
    def step(params, state, tokens):
        loss, grads = jax.value_and_grad(_loss)(params, tokens, heads)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(steps):
        tokens = np.empty((batch, seq + 1), np.int32)
        tokens[:, 0] = rng.integers(0, vocab, batch)
        for j in range(1, seq + 1):
            tokens[:, j] = successors[tokens[:, j - 1], rng.integers(0, 8, batch)]
        params, state, loss = step(params, state, tokens)
        losses.append(float(loss))
    adam = state[0]  # ScaleByAdamState(count, mu, nu)
    return params, {"mu": adam.mu, "nu": adam.nu}, losses


# ---- the measurement ------------------------------------------------------------------------------

def leaf_kinds(params: dict, moments: dict) -> dict[str, list[np.ndarray]]:
    """Leaf kind -> its arrays, as a checkpoint holds them (norm scales left out: tiny)."""
    import jax

    def big(tree):
        return [np.asarray(x) for x in jax.tree.leaves(tree) if np.asarray(x).ndim == 2]

    import ml_dtypes

    return {"params bf16": [a.astype(ml_dtypes.bfloat16) for a in big(params)],
            "params fp32": [a.astype(np.float32) for a in big(params)],
            "adam mu fp32": [a.astype(np.float32) for a in big(moments["mu"])],
            "adam nu fp32": [a.astype(np.float32) for a in big(moments["nu"])]}


def _chunks(arrays: list[np.ndarray], chunk_bytes: int = CHUNK_BYTES) -> list[np.ndarray]:
    out = []
    for a in arrays:
        flat = np.ascontiguousarray(a).reshape(-1)
        step = max(1, chunk_bytes // a.itemsize)
        # (as unsigned integers of the same width: numcodecs takes no bfloat16 buffer, and Blosc's
        # shuffle takes its element size from the buffer's)
        out += [flat[i:i + step].view(f"u{a.itemsize}") for i in range(0, flat.size, step)]
    return out


def _timed(fn, min_s: float) -> float:
    """Seconds one call of `fn` takes (repeated until `min_s` has passed; the fastest)."""
    best, spent = float("inf"), 0.0
    while spent < min_s or best == float("inf"):
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return best


def _figures(codec, chunks: list[np.ndarray], min_s: float) -> dict[str, float]:
    """Ratio, encode and decode GB/s of `codec` over `chunks`, every decode checked."""
    encoded = [codec.encode(c) for c in chunks]
    for c, e in zip(chunks, encoded):
        if np.frombuffer(codec.decode(e), c.dtype).tobytes() != c.tobytes():
            raise AssertionError(f"{codec}: a decoded chunk differs from its input")
    raw = sum(c.nbytes for c in chunks)
    enc = _timed(lambda: [codec.encode(c) for c in chunks], min_s)
    dec = _timed(lambda: [codec.decode(e) for e in encoded], min_s)
    return {"ratio": raw / sum(len(e) for e in encoded), "encode_gb_s": raw / enc / 1e9,
            "decode_gb_s": raw / dec / 1e9}


def measure(arrays: list[np.ndarray], min_s: float = MIN_TIMED_S) -> dict[str, dict[str, float]]:
    """Codec name -> ratio, encode and decode GB/s on one core, and the link it pays below (MB/s)."""
    import numcodecs
    from numcodecs import blosc

    blosc.set_nthreads(1)
    chunks = _chunks(arrays)
    out = {}
    for name, make in CODECS.items():
        f = _figures(make(numcodecs), chunks, min_s)
        f["pays_below_mb_s"] = f["encode_gb_s"] * 1e3 * (1 - 1 / f["ratio"])
        out[name] = f
    return out


# The chosen codec's settings swept on two leaf kinds: chunk sizes (below which a chunk is better
# stored raw) and lz4's level.
SWEEP_CHUNKS = (4 << 10, 64 << 10, 1 << 20, 4 << 20)
SWEEP_LEVELS = (1, 5, 9)


def sweep(arrays: list[np.ndarray], min_s: float = MIN_TIMED_S) -> dict[str, dict[str, float]]:
    """``blosc lz4 bitshuffle`` at each chunk size (level 5) and each level (4 MiB chunks)."""
    import numcodecs
    from numcodecs import blosc

    blosc.set_nthreads(1)
    out = {}
    for size, level in [(c, 5) for c in SWEEP_CHUNKS] + [(CHUNK_BYTES, lv) for lv in SWEEP_LEVELS if lv != 5]:
        codec = numcodecs.Blosc(cname="lz4", clevel=level, shuffle=numcodecs.Blosc.BITSHUFFLE)
        out[f"chunks {size >> 10} KiB, level {level}"] = _figures(codec, _chunks(arrays, size), min_s)
    return out


def run(steps: int, min_s: float = MIN_TIMED_S, **model: int) -> dict:
    """The figures of a state trained `steps` steps and of a random init (`model`: train's sizes)."""
    start = time.perf_counter()
    params, moments, losses = train(steps, **model)
    train_s = time.perf_counter() - start
    init_params, init_moments, _ = train(0, **model)
    result: dict[str, Any] = {"steps": steps, "train_s": train_s, "loss_first": losses[0] if losses else None,
                              "loss_last": losses[-1] if losses else None, "kinds": {}}
    for state, (p, m) in (("trained", (params, moments)), ("random init", (init_params, init_moments))):
        for kind, arrays in leaf_kinds(p, m).items():
            if state == "random init" and kind.startswith("adam"):
                continue  # (zero moments before the first step)
            result["kinds"][f"{kind}, {state}"] = {"mib": sum(a.nbytes for a in arrays) / 2**20,
                                                   "codecs": measure(arrays, min_s)}
    trained = leaf_kinds(params, moments)
    result["sweep"] = {kind: sweep(trained[kind], min_s) for kind in ("params bf16", "adam nu fp32")}
    return result


def print_table(result: dict) -> None:
    print(f"compression of a training state: {result['steps']} AdamW steps of a small transformer "
          f"(loss {result['loss_first']:.2f} -> {result['loss_last']:.2f}); one core, every decode checked")
    print(f"{'leaf kind':<28} {'codec':<24} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9} {'pays below MB/s':>16}")
    for kind, entry in result["kinds"].items():
        for name, f in entry["codecs"].items():
            print(f"{kind:<28} {name:<24} {f['ratio']:6.3f} {f['encode_gb_s']:9.3f} {f['decode_gb_s']:9.3f} "
                  f"{f['pays_below_mb_s']:16.0f}")
    print("\nblosc lz4 bit shuffle by chunk size and level (trained state)")
    print(f"{'leaf kind':<28} {'setting':<24} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9}")
    for kind, entry in result["sweep"].items():
        for name, f in entry.items():
            print(f"{kind:<28} {name:<24} {f['ratio']:6.3f} {f['encode_gb_s']:9.3f} {f['decode_gb_s']:9.3f}")


def main(args) -> int:
    result = run(args.steps)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0
