"""pipedejavu.costmodel.alpa."""
