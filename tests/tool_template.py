"""A small chat template with a tool-call format (the Hermes / Qwen `<tool_call>` JSON), written for the
tests: tool definitions in a system turn, assistant tool calls and tool results rendered in the turns."""

HERMES_STYLE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You can call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}To call one, write <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}{% elif message.role == "tool" %}<tool_response>
{{ message.content }}
</tool_response>{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
