"""Offload some blocks of a multi-layer cache to pinned host memory and bring them back.

One ``swap_blocks_multi_layer`` call moves the mapped blocks of every layer (docs/ops/transfer.md).
The blocks come back into other block ids, and every byte of both caches is checked: the reloaded
blocks hold the offloaded bytes, nothing else changed. On a GPU the host pool is pinned, the
offload runs on the SMs with a budget of 4 CTAs (zero-copy writes into the pinned pool) and the
reload takes engine "auto" (the copy engines, on a driver with batched copies); without a GPU both
sides are host tensors and the torch implementation copies them. Prints one line and exits 0 when
every check passed.
"""

import torch

import kvwrite

LAYERS, BLOCKS, HOST_SLOTS = 4, 64, 16
BLOCK_SIZE, HEADS, HEAD_SIZE = 16, 8, 128


def main() -> None:
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    # On the GPU: the offload on at most 4 CTAs, leaving the other SMs to the attention it would
    # overlap in a server ("sm": "auto" would pick the copy engines for these 64 KiB runs).
    # Without a GPU: the torch implementation, the only host-to-host one.
    offload_kw = {"engine": "sm", "max_ctas": 4} if gpu else {"implementation": "torch"}
    reload_kw = {} if gpu else {"implementation": "torch"}

    gen = torch.Generator().manual_seed(0)
    # vLLM's default per-layer order (LBNHC): [blocks, block_size, heads, K|V row], bfloat16 bits.
    shape = (BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD_SIZE)
    caches = [torch.randint(-2**15, 2**15, shape, generator=gen, dtype=torch.int16)
              .view(torch.bfloat16).to(device) for _ in range(LAYERS)]
    host = [torch.zeros((HOST_SLOTS, *shape[1:]), dtype=torch.bfloat16, pin_memory=gpu)
            for _ in range(LAYERS)]
    before = [c.clone() for c in caches]

    # Offload blocks 5, 17, 40, 63 to host slots 0..3 (a CPU mapping: checked during the call).
    blocks, slots = [5, 17, 40, 63], [0, 1, 2, 3]
    offload = torch.tensor([blocks, slots]).T     # [4, 2]; a transposed view: any strides do
    kvwrite.swap_blocks_multi_layer(caches, host, offload, **offload_kw)
    # Reload them into free blocks 0..3 (int32 ids are accepted too).
    free = [0, 1, 2, 3]
    reload = torch.tensor([slots, free], dtype=torch.int32).T
    kvwrite.swap_blocks_multi_layer(host, caches, reload, **reload_kw)
    if gpu:
        torch.cuda.current_stream().synchronize()  # the copies run on the current stream

    for layer in range(LAYERS):
        expected = before[layer].clone()
        expected[free] = before[layer][blocks]
        got, want = caches[layer].cpu().view(torch.uint8), expected.cpu().view(torch.uint8)
        assert torch.equal(got, want), f"layer {layer}: the cache differs from the expected bytes"
        pool = torch.zeros_like(host[layer])
        pool[slots] = before[layer][blocks].cpu()
        assert torch.equal(host[layer].view(torch.uint8), pool.view(torch.uint8)), (
            f"layer {layer}: the host pool differs from the expected bytes")

    where = "GPU <-> pinned host" if gpu else "host <-> host (torch)"
    print(f"offload_roundtrip: {LAYERS} layers x {len(blocks)} blocks of "
          f"{BLOCK_SIZE * HEADS * 2 * HEAD_SIZE * 2} bytes, {where}: every byte of both sides checked")


if __name__ == "__main__":
    main()
