"""stub"""
def export_attention(ctx, op):
    raise NotImplementedError
