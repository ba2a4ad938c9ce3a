"""pipedejavu.costmodel.profiling."""
