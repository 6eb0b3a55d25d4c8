"""The OpenAI front end's parts that are not the ingress itself: API keys, info routes."""
