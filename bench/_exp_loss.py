import sys, os, time, statistics, torch, torch.nn.functional as F
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import loss as L
print(torch.__version__, torch.cuda.get_device_name(), flush=True)
dev='cuda'; V,H=151936,4096
def bench(fn, iters=10, warm=3):
    for _ in range(warm): fn()
    ts=[]
    for _ in range(iters):
        a,b=torch.cuda.Event(enable_timing=True),torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
# 1. out_dtype correctness
a=torch.randn(300,500,device=dev,dtype=torch.bfloat16); b=torch.randn(500,700,device=dev,dtype=torch.bfloat16)
ref=a.double()@b.double()
r=torch.mm(a,b,out_dtype=torch.float32); print('mm out_dtype', r.dtype, ((r.double()-ref).norm()/ref.norm()).item())
acc=torch.randn(300,700,device=dev); acc0=acc.clone()
torch.addmm(acc,a,b,out_dtype=torch.float32,out=acc)
print('addmm aliased', ((acc.double()-acc0.double()-ref).norm()/ref.norm()).item(), flush=True)
# 2. components
w=(0.02*torch.randn(V,H,device=dev)).bfloat16()
for c in [2048,4096]:
    h=torch.randn(c,H,device=dev,dtype=torch.bfloat16); y=torch.randint(0,V,(c,1),device=dev)
    x=torch.mm(h,w.T,out_dtype=torch.float32); g=x.bfloat16(); dw=torch.zeros(V,H,device=dev)
    t={}
    t['mm bf16']=bench(lambda: h@w.T)
    t['mm fp32out']=bench(lambda: torch.mm(h,w.T,out_dtype=torch.float32))
    def elem():
        xx=x.clone()
        m=xx.amax(1,keepdim=True); e=xx.sub_(m).exp_(); s=e.sum(1,keepdim=True); e.scatter_add_(1,y,-s)
        return torch.div(e,s,out=torch.empty_like(e,dtype=torch.bfloat16))
    t['clone']=bench(lambda: x.clone())
    t['elem+clone']=bench(elem)
    t['dH mm']=bench(lambda: g@w)
    t['dW addmm fp32acc']=bench(lambda: torch.addmm(dw,g.T,h,out_dtype=torch.float32,out=dw))
    dwb=torch.zeros(V,H,device=dev,dtype=torch.bfloat16)
    t['dW addmm bf16']=bench(lambda: dwb.addmm_(g.T,h))
    def fused(x, y, s_dtype=torch.bfloat16):
        m=x.amax(1,keepdim=True); e=(x-m).exp(); s=e.sum(1,keepdim=True)
        loss=(m+s.log()-x.gather(1,y)).sum()
        p=e/s
        g=p - (torch.arange(x.shape[1],device=x.device)==y).float()
        return loss, g.to(s_dtype)
    fc=torch.compile(fused, dynamic=True)
    t0=time.time(); fc(x,y); torch.cuda.synchronize(); print('compile s', time.time()-t0, flush=True)
    t['compiled elem']=bench(lambda: fc(x,y))
    lc,gc=fc(x,y); 
    xx=x.clone(); m=xx.amax(1,keepdim=True); e=xx.sub_(m).exp_(); s=e.sum(1,keepdim=True); ll=(m+s.log()-x.gather(1,y)).sum(); e.scatter_add_(1,y,-s); ge=torch.div(e,s,out=torch.empty_like(e,dtype=torch.bfloat16))
    print('compiled vs eager', (lc-ll).abs().item()/ll.abs().item(), ((gc.float()-ge.float()).norm()/ge.float().norm()).item())
    print('chunk',c,{k:round(v,3) for k,v in t.items()}, flush=True)
    del x,g,dw,dwb,xx,e
# 3. full chunked at 16384 with compiled elementwise vs eager
N=16384
h=torch.randn(N,H,device=dev,dtype=torch.bfloat16,requires_grad=True); wq=w.clone().requires_grad_(); lab=torch.randint(0,V,(N,),device=dev)
for c in [2048,4096,8192]:
    def step():
        l,n=L.chunked_nll(h,wq,lab,chunk_size=c); (l/n).backward()
    h.grad=None; wq.grad=None
    print('full eager chunk',c, bench(step,iters=10), flush=True)
torch.cuda.synchronize(); h.grad=None; wq.grad=None
