"""The coordinator's routes, a router per OpenAPI tag, each route a function of its module that
gets the coordinator through `parts.Coord`. api.py includes them under /v1 with their scope."""
