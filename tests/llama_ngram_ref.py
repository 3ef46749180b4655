"""Line-by-line Python ports of llama.cpp's C++ (common/ngram-mod.cpp with the ngram-mod draft of
common/speculative.cpp, and common/ngram-map.cpp's common_ngram_map with values), with no
vectorisation and no shortcuts: the oracles tests/test_ngram_llama.py checks the drafters'
faster code against, on random token sequences. Names follow the C++."""

from __future__ import annotations

MASK = (1 << 64) - 1


class RefMod:
    """common_ngram_mod."""

    def __init__(self, n: int, size: int):
        self.n, self.entries, self.used = n, [-1] * size, 0

    def idx(self, tokens: list[int]) -> int:
        res = 0
        for i in range(self.n):
            res = (res * 6364136223846793005 + tokens[i]) & MASK
        return res % len(self.entries)

    def add(self, tokens: list[int]) -> None:
        i = self.idx(tokens)
        if self.entries[i] == -1:
            self.used += 1
        self.entries[i] = tokens[self.n]

    def get(self, tokens: list[int]) -> int:
        return self.entries[self.idx(tokens)]

    def reset(self) -> None:
        self.entries = [-1] * len(self.entries)
        self.used = 0


class RefModImpl:
    """common_speculative_impl_ngram_mod for one sequence: begin, draft_one, accept."""

    def __init__(self, mod: RefMod, n_min: int, n_max: int):
        self.mod, self.n_min, self.n_max = mod, n_min, n_max
        self.i_last = self.n_draft_last = self.n_low = 0

    def begin(self, prompt: list[int]) -> None:
        self.i_last = self.n_draft_last = 0
        n = self.mod.n
        if len(prompt) < n:
            return
        for i in range(len(prompt) - n):
            self.mod.add(prompt[i:])
        self.i_last = len(prompt) - n
        if self.mod.used / len(self.mod.entries) > 0.25:
            self.mod.reset()

    def draft(self, prompt: list[int], id_last: int) -> list[int]:
        self.n_draft_last = 0
        cur_len, n = len(prompt), self.mod.n
        if cur_len < n:
            return []
        if self.i_last + 32 < cur_len:
            for i in range(self.i_last, cur_len - n):
                self.mod.add(prompt[i:])
            self.i_last = cur_len - n
        result = [0] * (n + self.n_max)
        for i in range(n - 1):
            result[i] = prompt[cur_len - n + 1 + i]
        result[n - 1] = id_last
        for i in range(self.n_max):
            token = self.mod.get(result[i:])
            if token == -1:
                if i < self.n_min:
                    return []
                result = result[: n + i]
                break
            result[n + i] = token
        result = result[n:]
        self.n_draft_last = len(result)
        return result

    def accept(self, n_accepted: int, n_drafted: int) -> None:
        if self.n_draft_last > 0:
            if n_accepted / n_drafted < 0.25:
                self.n_low += 1
                if self.n_low >= 5:
                    self.mod.reset()
                    self.n_low = self.i_last = 0
            else:
                self.n_low = 0


class RefMap:
    """common_ngram_map with key_only = false: begin, draft, accept."""

    def __init__(self, n: int, m: int, min_hits: int):
        self.n, self.m, self.min_hits = n, m, min_hits
        self.keys: list[dict] = []
        self.key_map = [0] * 262144
        self.key_map_last_idx = self.size_last_begin = self.idx_last_check = 0
        self.last: tuple[int, int] | None = None

    @staticmethod
    def hash(tokens: list[int], start: int, length: int) -> int:
        h = 0
        for i in range(length):
            h = (h * 2654435761 + tokens[start + i]) & 0xFFFFFFFF
        return h

    def begin(self, tokens: list[int]) -> None:
        self.idx_last_check = self.size_last_begin = len(tokens)

    def matches(self, inp: list[int], j: int, key: list[int]) -> bool:
        return all(inp[j + k] == key[k] for k in range(self.n))

    def draft(self, inp: list[int], sampled: int) -> list[int]:
        self.last = None
        cur_len, n, m = len(inp), self.n, self.m
        if cur_len < 2 * n + m:
            return []
        assert self.idx_last_check <= cur_len and self.size_last_begin <= cur_len  # GGML_ABORTs
        self.idx_last_check = cur_len
        key = inp[cur_len - n + 1:] + [sampled]
        match_pos = 0
        idx_key = self.key_map[self.hash(key, 0, n) % 262144]
        if idx_key != 0 and idx_key < cur_len - n - m - 1 and self.matches(inp, idx_key, key):
            match_pos = idx_key
        if match_pos == 0 and self.size_last_begin > n + m + 1:
            j = self.size_last_begin - n - m - 1
            while j > self.key_map_last_idx:
                if self.matches(inp, j, key):
                    match_pos = j
                    break
                j -= 1
        if match_pos == 0:
            j = cur_len - n - m - 1
            while j > self.size_last_begin and j > self.key_map_last_idx:
                if self.matches(inp, j, key):
                    match_pos = j
                    break
                j -= 1
        if self.size_last_begin > n + m + 1:
            j = self.size_last_begin - n - m - 1
            while j > self.key_map_last_idx:
                slot = self.hash(inp, j, n) % 262144
                if self.key_map[slot] == 0:
                    self.key_map[slot] = j
                j -= 1
        j = cur_len - n - m - 1
        while j > self.size_last_begin and j > self.key_map_last_idx:
            slot = self.hash(inp, j, n) % 262144
            if self.key_map[slot] == 0:
                self.key_map[slot] = j
            j -= 1
        self.key_map_last_idx = max(cur_len - n - m - 1, self.key_map_last_idx)
        if match_pos == 0:
            return []
        offset = next((i for i, k in enumerate(self.keys) if self.matches(inp, k["key_idx"], key)), len(self.keys))
        if offset == len(self.keys):
            self.keys.append({"key_idx": match_pos, "stat_idx": 0, "key_num": 0,
                              "values": [{"idx": 0, "num": 0, "acc": m} for _ in range(4)]})
        key_stats = self.keys[offset]
        key_stats["key_num"] = min(key_stats["key_num"] + 1, 16380)
        if key_stats["key_num"] < self.min_hits:
            return []
        values = key_stats["values"]
        for i in range(key_stats["stat_idx"], match_pos + 1):
            if not self.matches(inp, i, key):
                continue
            begin, found = i + n, -1
            for v in range(4):
                if values[v]["idx"] == 0:
                    values[v].update(idx=begin, num=0, acc=m)
                    found = v
                    break
                if all(inp[begin + j] == inp[values[v]["idx"] + j] for j in range(m)):
                    found = v
                    break
            if found >= 0:
                values[found]["num"] = min(values[found]["num"] + 1, 16380)
        key_stats["stat_idx"] = match_pos
        max_occur, slot_max = 0, 0
        for v in range(4):
            if values[v]["num"] > max_occur:
                max_occur, slot_max = values[v]["num"], v
        sum_occur = sum(values[v]["num"] for v in range(4) if v != slot_max)
        if sum_occur > 0 and max_occur < 2 * sum_occur:
            return []
        self.last = (offset, slot_max)
        return [inp[match_pos + n + i] for i in range(min(m, values[slot_max]["acc"]))]

    def accept(self, n_accepted: int) -> None:
        if self.last is not None:
            self.keys[self.last[0]]["values"][self.last[1]]["acc"] = n_accepted
