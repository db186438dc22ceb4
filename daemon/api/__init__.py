"""The API faces: OpenAI's Chat Completions and Completions (openai.py, its bodies in openai_bodies.py),
Ollama's (ollama.py), Anthropic's Messages (anthropic.py) and OpenAI's Responses (responses.py), each only
parsing its bodies into a generation.spec.Generation, encoding what the pipeline gives back and putting
errors in its shape; the OpenAPI document of them all (openapi.py, with the small bodies in schemas.py)."""
