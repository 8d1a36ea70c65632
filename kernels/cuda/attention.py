"""stub"""
def attention_gpu(op, ins, ctx):
    raise NotImplementedError
def attention_grad_gpu(op, ins, ctx):
    raise NotImplementedError
