"""The OpenAI front end: the ingress deployment (`openai_ingress.py`) and its parts: vLLM's
render/derender layer (`render.py`), response bodies (`responses.py`), the info routes, API
keys, prompt tokenization for routing, and the merge of one request's sequences."""
