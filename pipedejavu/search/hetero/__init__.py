"""pipedejavu.search.hetero."""
