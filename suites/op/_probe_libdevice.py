"""One-off probe (deleted after use): tl.exp/tl.log vs libdevice exp/log in the logp kernel."""
import importlib.util, sys, torch, triton
src = open("kernels/ops/logp.py").read()
src = src.replace("import triton.language as tl\n", "import triton.language as tl\nfrom triton.language.extra import libdevice\n")
src = src.replace("tl.exp(", "libdevice.exp(").replace("tl.log(", "libdevice.log(")
open("/tmp/logp_precise.py", "w").write(src)
spec = importlib.util.spec_from_file_location("logp_precise", "/tmp/logp_precise.py")
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
from kernels.ops import logp as base
sys.path.insert(0, "suites/op")
from rlk_op_cases import make_logits, make_ids
for V in (32000, 151936):
  for temp in (1.0, 0.7):
    logits = make_logits(4096, V, torch.float32, seed=4096 + V)
    ids = make_ids(4096, V, seed=V)
    g = torch.randn(4096, generator=torch.Generator().manual_seed(3)).cuda()
    z64 = (logits.double() / temp).requires_grad_()
    lp64 = torch.log_softmax(z64, -1).gather(-1, ids.clamp(min=0)[:, None]).squeeze(-1)
    lp64 = torch.where(ids == -100, 0.0, lp64); lp64.backward(g)
    d64 = (z64.grad / temp)
    z32 = logits.clone().requires_grad_()
    lp32 = torch.log_softmax(z32 / temp, -1).gather(-1, ids.clamp(min=0)[:, None]).squeeze(-1)
    lp32 = torch.where(ids == -100, 0.0, lp32); lp32.backward(g)
    row = f"V={V} t={temp}: fp32-ref vs fp64 logp {float((lp32.double()-lp64).abs().max()):.2e} dlogits {float((z32.grad.double()-d64).abs().max()):.2e}"
    print(row)
    for name, m in (("tl.exp", base), ("libdevice", mod)):
        x = logits.clone().requires_grad_()
        out = m.logp(x, ids, temp); out.backward(g)
        e_lp = float((out.double() - lp64).abs().max()); e_d = float((x.grad.double() - d64).abs().max())
        e_d32 = float((x.grad - z32.grad).abs().max())
        with torch.no_grad():
            fwd = triton.testing.do_bench(lambda: m.logp(logits, ids, temp))
        xx = logits.clone().requires_grad_()
        fb = triton.testing.do_bench(lambda: torch.autograd.grad(m.logp(xx, ids, temp), xx, g))
        print(f"  {name:10s} vs fp64: logp {e_lp:.2e} dlogits {e_d:.2e} | dlogits vs fp32 ref {e_d32:.2e} | fwd {fwd:.3f} ms fwd+bwd {fb:.3f} ms")
    del logits, z64, z32, d64; torch.cuda.empty_cache()
