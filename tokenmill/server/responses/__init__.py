"""OpenAI's Responses API (/v1/responses): the request and its input items
(`protocol`), their translation into a chat conversation (`conversation`), the
output items and stream events (`output`), and the response store (`store`)."""
