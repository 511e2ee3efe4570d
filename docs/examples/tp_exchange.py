"""Exchange blocks between tensor-parallel sizes through transfer pages: TP = 2 -> TP = 1.

Two "ranks" each hold half of the 8 KV heads, in two of vLLM's per-layer stride orders (LBNHC and
LBHNC). Each packs its heads of three blocks, all layers, into one shared page buffer with
``pack_kv_pages(head_range=...)``: a page keeps heads outermost, so a rank's heads are one
contiguous range of each page. A TP = 1 cache in a third order (BHLNC: one allocation whose block
stride spans every layer) unpacks whole pages. Done for raw pages (every byte checked, the page's
layout too) and fp8 pages (the cache receives fp8(x / σ) · σ of each element). See
docs/ops/transfer.md. Runs on a GPU if present, else on the CPU with the torch implementation.
Prints one line and exits 0 when every check passed.
"""

import torch

import kvwrite

LAYERS, HEADS, BLOCK_SIZE, HEAD_SIZE, BLOCKS = 2, 8, 16, 64, 8
ROW = 2 * HEAD_SIZE          # C: vLLM's K|V row, so kv_split = 2
TP = 2
SPLIT = HEADS // TP          # heads per rank


def rank_cache(device, rank, truth):
    """Rank ``rank``'s heads [rank*SPLIT, (rank+1)*SPLIT) of each layer, as the logical
    (blocks, SPLIT, N, C) view; rank 0 LBNHC ([blocks, N, H, C] in memory), rank 1 LBHNC."""
    heads = slice(rank * SPLIT, (rank + 1) * SPLIT)
    caches = []
    for layer in truth:
        if rank == 0:
            cache = torch.empty(BLOCKS, BLOCK_SIZE, SPLIT, ROW, dtype=layer.dtype,
                                device=device).transpose(1, 2)
        else:
            cache = torch.empty(BLOCKS, SPLIT, BLOCK_SIZE, ROW, dtype=layer.dtype, device=device)
        cache.copy_(layer[:, heads])
        caches.append(cache)
    return caches


def exchange(device, page_format, truth, kw):
    """Pack blocks 3, 0, 6 from both ranks into page rows 0..2, unpack them into blocks 1, 5, 2 of
    a TP = 1 cache. Returns the TP = 1 cache (one tensor per layer), its bytes before, the page pool
    and the pool's bytes before."""
    # σ per head: rank r passes its heads' entries ([H_c] broadcasts to [L, S, H_c]).
    sigma = torch.tensor([0.02 * (h + 1) for h in range(HEADS)], device=device)
    page_bytes = kvwrite.kv_page_bytes(LAYERS, HEADS, BLOCK_SIZE, ROW, truth[0].dtype, kv_split=2,
                                       page_format=page_format)
    # The pages: rows of a larger pool (row stride past P, one spare row), so the check can see
    # that nothing outside the mapped rows' P bytes is written.
    pool = torch.full((4, page_bytes + 32), 0xAB, dtype=torch.uint8, device=device)
    pool_before = pool.clone()
    pages = pool[:, :page_bytes]

    pack = torch.tensor([[3, 0], [0, 1], [6, 2]])          # (cache block, page row), on the host
    for rank in range(TP):
        h0 = rank * SPLIT
        kvwrite.pack_kv_pages(rank_cache(device, rank, truth), pages, pack, kv_split=2,
                              head_range=(h0, h0 + SPLIT), page_format=page_format,
                              scale=sigma[h0:h0 + SPLIT], **kw)

    # TP = 1, BHLNC: [blocks, H, L, N, C] in memory; layer l is the view [:, :, l].
    full = torch.randn(BLOCKS, HEADS, LAYERS, BLOCK_SIZE, ROW, device=device).to(truth[0].dtype)
    full_before = full.clone()
    caches = [full[:, :, layer] for layer in range(LAYERS)]
    unpack = torch.tensor([[0, 1], [1, 5], [2, 2]], device=device)  # (page row, block); GPU: read there
    kvwrite.unpack_kv_pages(pages, caches, unpack, kv_split=2, page_format=page_format, **kw)
    if device == "cuda":
        torch.cuda.current_stream().synchronize()
    return full, full_before, pool, pool_before, pages, sigma


def expect_equal(got, want, what):
    """The bytes of ``got`` and ``want``, each in index order, are the same."""
    assert torch.equal(got.cpu().contiguous().view(torch.uint8).flatten(),
                       want.cpu().contiguous().view(torch.uint8).flatten()), f"{what} differs"


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = {} if device == "cuda" else {"implementation": "torch"}
    gen = torch.Generator().manual_seed(0)
    truth = [torch.randn(BLOCKS, HEADS, BLOCK_SIZE, ROW, generator=gen).to(torch.bfloat16)
             .to(device) for _ in range(LAYERS)]  # logical (blocks, H, N, C), every head
    src_blocks, dst_blocks = [3, 0, 6], [1, 5, 2]

    # Raw: the TP = 1 cache receives every bit; the page layout is the contract's.
    full, full_before, pool, pool_before, pages, _ = exchange(device, "raw", truth, kw)
    want = full_before.clone()
    for layer in range(LAYERS):
        want[dst_blocks, :, layer] = truth[layer][src_blocks]
    expect_equal(full, want, "raw: the TP = 1 cache")
    # Page row 0, head chunk h: for each layer l, part s (K, V), token t, the E = C/2 elements of
    # head h's row part, in that order (heads outermost).
    chunk = pages.shape[1] // HEADS
    for h in range(HEADS):
        layout = torch.stack([layer[3, h].reshape(BLOCK_SIZE, 2, HEAD_SIZE).transpose(0, 1)
                              for layer in truth])
        expect_equal(pages[0, h * chunk:(h + 1) * chunk], layout, f"raw: page 0, head chunk {h}")
    want_pool = pool_before.clone()
    want_pool[:3, :pages.shape[1]] = pages[:3]
    expect_equal(pool, want_pool, "raw: the page pool outside rows 0..2")

    # fp8: each cache element becomes D(Q(x)) = fp8(float32(x) / σ) · σ, rounded to bfloat16.
    full, full_before, pool, pool_before, pages, sigma = exchange(device, "fp8", truth, kw)
    want = full_before.clone()
    s = sigma.view(HEADS, 1, 1)
    for layer in range(LAYERS):
        x = truth[layer][src_blocks].float()
        codes = (x / s).to(torch.float8_e4m3fn)
        want[dst_blocks, :, layer] = (codes.float() * s).to(torch.bfloat16)
    expect_equal(full, want, "fp8: the TP = 1 cache")
    chunk = pages.shape[1] // HEADS
    for h in range(HEADS):  # each chunk opens with its σ(l, s), L*S float32s: here σ of head h
        head_scales = pages[0, h * chunk:h * chunk + 4 * LAYERS * 2].view(torch.float32)
        expect_equal(head_scales, sigma[h].expand(LAYERS * 2), f"fp8: the scales of chunk {h}")

    where = "GPU" if device == "cuda" else "CPU (torch)"
    print(f"tp_exchange: TP=2 -> TP=1 through {len(src_blocks)} pages of {LAYERS} layers x "
          f"{HEADS} heads on {where}: raw bytes and page layout, fp8 read fp8(x/s)*s, checked")


if __name__ == "__main__":
    main()
