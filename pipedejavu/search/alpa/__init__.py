"""pipedejavu.search.alpa."""
