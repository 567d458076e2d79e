"""`python -m bench --compression` (bench/compression.py) run for real at a tiny size: a training
run whose loss falls, every codec's decode equal to its input (the benchmark checks it), and the
figures all there. No timing assertions: those are the benchmark's figures."""

import math

from bench import compression


def test_every_kind_and_codec_is_measured():
    result = compression.run(30, min_s=0.0, vocab=64, dim=32, layers=1, heads=2, batch=8, seq=16)
    assert result["loss_last"] < result["loss_first"]
    kinds = {"params bf16", "params fp32", "adam mu fp32", "adam nu fp32"}
    assert set(result["kinds"]) == {f"{k}, trained" for k in kinds} | {"params bf16, random init",
                                                                       "params fp32, random init"}
    for kind, entry in result["kinds"].items():
        assert set(entry["codecs"]) == set(compression.CODECS), kind
        for f in entry["codecs"].values():
            assert all(math.isfinite(v) and v > 0 for k, v in f.items() if k != "pays_below_mb_s"), (kind, f)
    # bfloat16 weights near N(0, 0.02) have a narrow exponent: every shuffled codec stores fewer bytes
    assert set(result["sweep"]) == {"params bf16", "adam nu fp32"}
    assert all(len(e) == 6 and all(f["ratio"] > 0 for f in e.values()) for e in result["sweep"].values())
    bf16 = result["kinds"]["params bf16, trained"]["codecs"]
    assert bf16["blosc-zstd1-bitshuffle"]["ratio"] > 1.1 and bf16["zstd-1"]["ratio"] > 1.1
