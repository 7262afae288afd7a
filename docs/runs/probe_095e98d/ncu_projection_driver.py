"""One launch of each projection kernel of interest (run under ncu)."""
import torch
from dsv4_compressor.kernels import projection as proj
from dsv4_compressor.bench.probes.tune_projection import _read_kernel

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
D = 4096
x = torch.randn(64, D, device=dev, generator=g).to(torch.bfloat16)
ws = {n: (torch.randn(n, D, device=dev, generator=g) / 64).to(torch.bfloat16) for n in (2048, 512, 1024)}
for n, w in ws.items():
    cfg = proj.projection_config(64, n, D)
    space = torch.zeros(proj.workspace_numel(64, n, cfg), device=dev)
    proj.launch_projection(x, w, space, rows=64, cfg=cfg, pdl=False)
for cfg in (proj.ProjectionConfig(64, 32, 128, 4, 4, 4), proj.ProjectionConfig(64, 128, 128, 8, 4, 4),
            proj.ProjectionConfig(64, 64, 128, 4, 4, 4)):
    space = torch.zeros(proj.workspace_numel(64, 2560, cfg), device=dev)
    proj.launch_projection(x, ws[2048], space, rows=64, cfg=cfg, pdl=False, weight2=ws[512])
w = ws[2048]
out = torch.empty(1024, device=dev)
for programs, block, warps in ((256, 4096, 4), (512, 4096, 8), (1024, 2048, 4)):
    _read_kernel[(programs,)](w, out, CHUNK=w.numel() // programs, BLOCK=block, num_warps=warps, num_stages=4)
torch.mm(x, w.t(), out_dtype=torch.float32)
torch.cuda.synchronize()
print("done")
