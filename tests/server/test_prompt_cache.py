"""The prompt cache through the server: a second chat turn reuses the first turn's prompt
(`usage.prompt_tokens_details.cached_tokens`) and answers exactly as a server with the cache off;
with --kv-disk the prefix is found again after a restart."""
import tempfile

from conftest import Server

DOC = "The history of the printing press is the history of how ideas learned to travel. " * 20


def conversation(client, turns=2):
    messages = [{"role": "system", "content": "Read this document:\n\n" + DOC}]
    out = []
    for q in ["Who is this text about?", "Summarize it in one sentence.", "Give it a title."][:turns]:
        messages.append({"role": "user", "content": q})
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        out.append((r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
    return out


def test_second_turn_hits_and_equals_the_uncached_answer(server):
    on = conversation(server.client())
    off_server = Server("--prompt-cache-bytes", "0")
    try:
        off = conversation(off_server.client())
    finally:
        off_server.stop()
    assert [t[0] for t in on] == [t[0] for t in off]
    (_, p1, c1), (_, p2, c2) = on
    assert c1 == 0 or c1 < p1
    assert c2 >= p1 - 1, (p1, c2)
    assert all(t[2] == 0 for t in off)


def test_the_disk_tier_serves_a_prefix_after_a_restart():
    with tempfile.TemporaryDirectory() as d:
        s = Server("--kv-disk", d)
        try:
            first = conversation(s.client(), turns=1)
        finally:
            s.stop()
        s = Server("--kv-disk", d)
        try:
            again = conversation(s.client(), turns=1)
            metrics = s.metrics()
        finally:
            s.stop()
    (a1, p1, _), (a2, p2, c2) = first[0], again[0]
    assert a1 == a2
    assert c2 == p2 - 1, "all but the last prompt token came from disk"
    assert metrics["ferrolm_prompt_cache_disk_hits_total"] == 1
