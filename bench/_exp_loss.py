import sys, os, time, statistics, torch, torch.nn.functional as F
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import loss as L
from torch.profiler import profile, ProfilerActivity
dev='cuda'; V,H,N=151936,4096,16384
w=(0.02*torch.randn(V,H,device=dev)).bfloat16().requires_grad_()
h=torch.randn(N,H,device=dev,dtype=torch.bfloat16).requires_grad_(); lab=torch.randint(0,V,(N,),device=dev)
x=torch.randn(4096,V,device=dev); y=lab[:4096,None]
l1,g1=L._nll_and_dlogits_cuda(x,y,torch.bfloat16); l2,g2=L._nll_and_dlogits(x,y,torch.bfloat16)
print('compiled vs eager', ((l1-l2)/l2).item(), ((g1.float()-g2.float()).norm()/g2.float().norm()).item())
del x,g1,g2
for c in [2048,4096]:
    def step():
        l,n=L.chunked_nll(h,w,lab,chunk_size=c); (l/n).backward()
    for _ in range(3): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3): step()
        torch.cuda.synchronize()
    print('chunk', c)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    prof.export_chrome_trace(os.environ['OUT']+f'/trace{c}.json')
