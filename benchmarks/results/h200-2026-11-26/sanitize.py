"""Run every prebuilt kernel in gpu_run/kernels once on random data (under compute-sanitizer)."""
import glob, sys
import torch
from tbe_like import load_kernel

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
names = sys.argv[1:] or sorted(glob.glob("gpu_run/kernels/*.json"))
for path in names:
    k = load_kernel(path)
    g = torch.Generator().manual_seed(0)
    ins = [torch.randn(t.shape, generator=g).to(DT[t.dtype]).cuda() for t in k.inputs]
    out = k(*ins)
    torch.cuda.synchronize()
    print("ran", path, tuple(out.shape), float(out.float().abs().max()), flush=True)
