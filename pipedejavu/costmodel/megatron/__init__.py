"""pipedejavu.costmodel.megatron."""
