"""pipedejavu.search.engine."""
