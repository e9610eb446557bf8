"""CPU model of src/backend/cuda/mma.cu (no GPU needed; numpy only), written before the kernel ran.

1. The fragment mappings (bf16, and INT4 with its nibble unpack): builds the m16n8k16 A / B operands from what each lane loads (PTX ISA
   fragment layouts for .bf16), multiplies, scatters D back to lanes and checks that the epilogue's
   (weight row, token) reading of the accumulators equals x · Wᵀ.
2. The exact three-part split of fp32 x (bit truncation) for |x| ≥ 2^-103.
3. An error model at K = 7168 under a pessimistic tensor-core accumulation (every addend truncated
   toward zero to 2^-23 of the largest, exact sum, result truncated to fp32): the three-part path,
   a two-part path and a plain fp32 loop against fp64 (the op-parity rule allows 2× plain).

Usage: python bench/mma_model.py   (numpy; about a second)
"""
import numpy as np

rng = np.random.default_rng(1)


def check_fragments():
    K = 32
    W = rng.standard_normal((16, K)).astype(np.float32)
    X = rng.standard_normal((8, K)).astype(np.float32)
    acc = np.zeros((32, 4))
    for s in range(2):
        A = np.full((16, 16), np.nan)
        B = np.full((16, 8), np.nan)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            k = 8 * t
            wg, wg8, xv = W[g, k:k + 8], W[g + 8, k:k + 8], X[g, k:k + 8]
            pair = lambda v, c: (v[2 * c], v[2 * c + 1])  # uint4 component c: elements 2c, 2c+1
            a = [pair(wg, 2 if s else 0), pair(wg8, 2 if s else 0), pair(wg, 3 if s else 1), pair(wg8, 3 if s else 1)]
            xs = xv[4:8] if s else xv[0:4]
            b = [(xs[0], xs[1]), (xs[2], xs[3])]
            for ai in range(8):  # PTX: a0,a1,a4,a5 row g; a2,a3,a6,a7 row g+8; col 2t + (i&1) (+8 for i ≥ 4)
                row = g if ai in (0, 1, 4, 5) else g + 8
                A[row, 2 * t + (ai & 1) + (8 if ai >= 4 else 0)] = a[ai // 2][ai & 1]
            for bi in range(4):  # b0,b1 rows 2t, 2t+1; b2,b3 rows 2t+8, 2t+9; col g
                B[2 * t + (bi & 1) + (8 if bi >= 2 else 0), g] = b[bi // 2][bi & 1]
        assert not np.isnan(A).any() and not np.isnan(B).any()
        D = A @ B
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for ci in range(4):  # c0,c1 row g; c2,c3 row g+8; col 2t + (i&1)
                acc[lane, ci] += D[g + (8 if ci >= 2 else 0), 2 * t + (ci & 1)]
    Y = np.full((8, 16), np.nan)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):  # the kernel's reading: weight row g + 8·(i/2), token 2t + i%2
            Y[2 * t + (i & 1), g + 8 * (i >> 1)] = acc[lane, i]
    err = np.abs(Y - X.astype(np.float64) @ W.astype(np.float64).T).max()
    assert err < 1e-9, err
    print("fragment mapping: ok (max |err| %.2g)" % err)


def check_int4_fragments():
    """INT4: lane (g, t) holds word t of the group (nibbles e0..e7 = columns 8t..8t+7, LSB first);
    step s: A registers (e_2s, e_2s+4) and (e_2s+1, e_2s+5) of rows g | g+8, B (x0.x, x1.x)… as mma.cu."""
    K = 32
    nib = rng.integers(0, 16, size=(16, K))
    words = np.zeros((16, 4), np.uint64)
    for r in range(16):
        for wi in range(4):
            for e in range(8):
                words[r, wi] |= np.uint64(nib[r, 8 * wi + e]) << np.uint64(4 * e)
    X = rng.standard_normal((8, K)).astype(np.float32)

    def nibble_pair(q, j):  # bf16x2 (e_j − 8, e_{j+4} − 8) as two numbers (low, high)
        v = ((int(q) >> (4 * j)) & 0x000F000F) | 0x43004300
        lo16, hi16 = v & 0xFFFF, v >> 16
        f = lambda b: np.array([b << 16], np.uint32).view(np.float32)[0]
        return (f(lo16) * 1.0 - 136.0, f(hi16) * 1.0 - 136.0)

    D = np.zeros((16, 8))
    for s in range(2):
        A = np.full((16, 16), np.nan)
        B = np.full((16, 8), np.nan)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            qg, qg8 = words[g, t], words[g + 8, t]
            a = [nibble_pair(qg, 2 * s), nibble_pair(qg8, 2 * s), nibble_pair(qg, 2 * s + 1), nibble_pair(qg8, 2 * s + 1)]
            x0, x1 = X[g, 8 * t:8 * t + 4], X[g, 8 * t + 4:8 * t + 8]
            b = [(x0[2 * s], x1[2 * s]), (x0[2 * s + 1], x1[2 * s + 1])]
            for ai in range(8):
                row = g if ai in (0, 1, 4, 5) else g + 8
                A[row, 2 * t + (ai & 1) + (8 if ai >= 4 else 0)] = a[ai // 2][ai & 1]
            for bi in range(4):
                B[2 * t + (bi & 1) + (8 if bi >= 2 else 0), g] = b[bi // 2][bi & 1]
        assert not np.isnan(A).any() and not np.isnan(B).any()
        D += A @ B
    ref = (nib - 8).astype(np.float64) @ X.astype(np.float64).T  # [16 rows, 8 tokens]
    err = np.abs(D - ref).max()
    assert err < 1e-9, err
    print("INT4 fragment mapping and nibble unpack: ok (max |err| %.2g)" % err)


def top16(a):
    return (a.view(np.uint32) & 0xFFFF0000).view(np.float32)


def split3(x):
    hi = top16(x)
    r = (x - hi).astype(np.float32)
    mid = top16(r)
    lo = (r - mid).astype(np.float32)
    return hi, mid, lo


def check_split():
    for scale in [1e-20, 1e-3, 1.0, 1e3, 1e30]:
        a = (rng.standard_normal(1_000_000) * scale).astype(np.float32)
        a = a[np.abs(a) >= 2.0 ** -103]
        hi, mid, lo = split3(a)
        assert np.all(top16(lo) == lo), scale  # lo is a bf16
        assert np.all(hi.astype(np.float64) + mid + lo == a.astype(np.float64)), scale
    print("three-part split: exact")


def rz32(v):
    f = v.astype(np.float32)
    bad = np.abs(f.astype(np.float64)) > np.abs(v)
    f[bad] = np.nextafter(f[bad], np.float32(0))
    return f


def tensor_core(C, prods):
    allv = np.concatenate([C[:, None].astype(np.float64), prods], axis=1)
    emax = np.floor(np.log2(np.maximum(np.abs(allv).max(axis=1), 1e-300)))
    q = 2.0 ** (emax - 23)
    return rz32((np.trunc(allv / q[:, None]) * q[:, None]).sum(axis=1))


def error_model(K=7168, R=200, KS=4):
    u = (rng.standard_normal((R, K)) / np.sqrt(K)).astype(np.float32).view(np.uint32).astype(np.uint64)
    W = ((((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32)).view(np.float32)  # bf16 weights
    x = rng.standard_normal(K).astype(np.float32)
    ref = W.astype(np.float64) @ x.astype(np.float64)
    rel = lambda y: np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref)
    plain = np.zeros(R, np.float32)
    for k in range(K):
        plain = (plain + W[:, k] * x[k]).astype(np.float32)
    results = {}
    for name, parts in (("three parts", split3(x)[::-1]), ("two parts", split3(x)[:2][::-1])):
        tot = None
        for w in range(KS):
            a = np.zeros(R, np.float32)
            for kb in range(w, (K + 31) // 32, KS):
                for s in range(2):
                    ks = np.arange(kb * 32 + 16 * s, min(kb * 32 + 16 * s + 16, K))  # the tail reads zeros
                    if len(ks) == 0:
                        ks = np.arange(0)
                    d = np.zeros(R, np.float32)
                    for p in parts:  # small parts first, as the kernel
                        d = tensor_core(d, W[:, ks].astype(np.float64) * p[ks].astype(np.float64))
                    a = (a + d).astype(np.float32)
            tot = a if tot is None else (tot + a).astype(np.float32)
        results[name] = rel(tot)
    print("K = %d: plain fp32 %.3g, MMA three parts %.3g, two parts %.3g" % (K, rel(plain), results["three parts"], results["two parts"]))


if __name__ == "__main__":
    check_fragments()
    check_int4_fragments()
    check_split()
    error_model()
