"""pipedejavu.costmodel.goodput."""
