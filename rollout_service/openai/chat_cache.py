"""The chat tokenizers of the OpenAI routes, one per distinct tool list (an LRU of
``CHAT_CACHE``): rendering a conversation with its tools' schemas in the system prompt needs
a :class:`~asyncrl.chat.ChatTokenizer` built for that tool list."""

from __future__ import annotations

from collections import OrderedDict

from asyncrl.chat import ChatTokenizer

CHAT_CACHE = 64  # chat tokenizers kept per distinct tool list


class ChatCache:
    """``get(key, tools)``: the tokenizer for this tool list (``key`` identifies it), built once."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: OrderedDict[str, ChatTokenizer] = OrderedDict()

    def get(self, key: str, tools: list[dict] | None) -> ChatTokenizer:
        chat = self._cache.get(key)
        if chat is None:
            chat = ChatTokenizer(self.tokenizer, tools)
            self._cache[key] = chat
            while len(self._cache) > CHAT_CACHE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return chat
