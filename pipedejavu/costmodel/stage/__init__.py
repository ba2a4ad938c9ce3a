"""pipedejavu.costmodel.stage."""
