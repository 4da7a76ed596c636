import torch, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
import tcal  # noqa
from tcal.evaluate.niah import make_samples, haystack_documents, generate_greedy
path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(path).eval()
tok = AutoTokenizer.from_pretrained(path)
for length, idxs in ((1024, [2]), (2048, [1, 2, 5])):
    items = make_samples("single", tok, length, 10, seed=0, documents=haystack_documents("single", "sotu:eval"))
    for i in idxs:
        s = items[i]
        ids = tok(s.prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = []
        with torch.no_grad():
            x = ids
            for _ in range(10):
                nxt = model(x).logits[0, -1].argmax()
                out.append(int(nxt)); x = torch.cat([x, nxt.view(1, 1)], 1)
        cached1 = generate_greedy(model, tok, [s.prompt], 10, batch_size=1)[0]
        print(length, i, s.answers, "no cache:", repr(tok.decode(out)), "cached bs1:", repr(cached1), flush=True)
