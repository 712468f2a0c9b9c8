"""A GPU probe: can megatron-core's torch_dist load read FP32
checkpoint tensors straight into BF16 / FP16 targets, in place, bit for bit as TE's cast?"""
import os, tempfile, torch, torch.distributed as dist

def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29731")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(1 << 20, generator=g, device="cuda") * 1e-3
    d = tempfile.mkdtemp()
    dist_checkpointing.save({"x": ShardedTensor.from_rank_offsets("x", src, replica_id=0)}, d)
    for dtype, cast in ((torch.bfloat16, lambda t: t.bfloat16()), (torch.float16, lambda t: t.half())):
        target = torch.zeros(1 << 20, dtype=dtype, device="cuda")
        ptr = target.data_ptr()
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        try:
            loaded = dist_checkpointing.load({"x": ShardedTensor.from_rank_offsets("x", target, replica_id=0)}, d)["x"]
            torch.cuda.synchronize()
            print(dtype, "loaded as", loaded.dtype, "in place:", loaded.data_ptr() == ptr,
                  "bitwise == cast:", torch.equal(loaded.view(torch.int16), cast(src).view(torch.int16)),
                  "peak over base MiB:", (torch.cuda.max_memory_allocated() - base) / 2**20)
        except Exception as e:
            print(dtype, "FAILED:", type(e).__name__, str(e)[:400])
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
