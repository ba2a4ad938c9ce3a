"""pipedejavu.search.megatron."""
