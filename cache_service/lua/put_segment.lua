-- Atomically add one segment to a rollout hash.
-- KEYS[1]  rollout hash  (<prefix>[:<namespace>]:{<rollout_id>})
-- ARGV     meta, start, end, value, digest, info, ttl_ms, max_segments, nbytes, ref,
--          ctx_field, ctx, base_field, max_gap, max_gap_total, token, chunk fields...
--          value is the frame, or "@<blob key>" when the frame is shared (ref = blob key, else "");
--          token: the blob reference put_blob.lua took for this put ("" if none)
--          ctx_field/ctx: "c:<digest>" and the context bytes a self-contained frame carries
--          ("" for a continuation frame); base_field: "c:<digest>" a continuation frame
--          needs (else ""); max_gap: rows a segment may start past the stored end;
--          max_gap_total: rows of the rollout no segment covers, in all, after this put;
--          chunk fields: name, bytes pairs of a frame stored chunked (value is then the
--          frame's head; r3_client/stored/fields.py names them k:<a>:<b>:...)
-- Fields:  m = rollout meta (E, K, layers; must match across segments)
--          s:<a>:<b> = frame, its head (chunks in k:<a>:<b>:... fields) or "@<blob key>",
--          d:<a>:<b> = content digest,
--          h:<a>:<b> = segment info, r:<a>:<b> = blob key of a shared segment,
--          t:<a>:<b> = the token of its reference in that blob (released on delete)
--          b = total frame bytes, sb = bytes of shared segments, n = segment count
--          c:<digest> = a rollout context (format v2) that continuation frames name
-- Returns  {"stored", kept, refs...} | {"duplicate", kept, refs...} | {"meta", stored_meta}
--          | {"conflict", "<a>:<b>", "differs"|"overlaps"} | {"full", n}
--          | {"nobase"} | {"gap", stored_end} | {"gaps", gap rows after this put}
--          kept = "1" when the rollout's segment now holds this put's blob reference, else
--          "0" (the caller then releases it: unref_blob.lua); refs = blob keys this rollout
--          references (their TTLs are refreshed by the caller)
local key = KEYS[1]
local meta, s, e = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local value, dig, info = ARGV[4], ARGV[5], ARGV[6]
local ttl, max_segments, nbytes, ref = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10]
local ctx_field, ctx, base_field, max_gap = ARGV[11], ARGV[12], ARGV[13], tonumber(ARGV[14])
local max_gap_total, token = tonumber(ARGV[15]), ARGV[16]

-- Every write of a rollout resets its TTL and its views' (one lifetime: no view outlives
-- or predeceases its rollout).
local function refresh(status, kept)
  local keys = {key}
  local out = {status, kept}
  for _, f in ipairs(redis.call('HKEYS', key)) do
    local v = string.match(f, '^v:(%d+)$')
    if v then
      keys[#keys + 1] = key .. ':v:' .. v
    elseif string.sub(f, 1, 2) == 'r:' then
      out[#out + 1] = redis.call('HGET', key, f)
    end
  end
  for _, k in ipairs(keys) do
    if ttl > 0 then redis.call('PEXPIRE', k, ttl) else redis.call('PERSIST', k) end
  end
  return out
end

local cur = redis.call('HGET', key, 'm')
if cur and cur ~= meta then return {'meta', cur} end
local stored_end, covered = 0, 0
for _, f in ipairs(redis.call('HKEYS', key)) do
  local a, b = string.match(f, '^d:(%d+):(%d+)$')
  if a then
    a = tonumber(a); b = tonumber(b)
    if b > stored_end then stored_end = b end
    covered = covered + (b - a)  -- stored segments never overlap
    if a < e and s < b then
      if a == s and b == e then
        if redis.call('HGET', key, f) == dig then
          -- Rewrite one unchanged field: a write, so a WAIT/WAITAOF after this script
          -- covers the segment an earlier (maybe unconfirmed) put stored (store/durability.py).
          redis.call('HSET', key, 'm', meta)
          local held = token ~= '' and redis.call('HGET', key, 't:' .. s .. ':' .. e) == token
          return refresh('duplicate', held and '1' or '0')
        end
        return {'conflict', a .. ':' .. b, 'differs'}
      end
      return {'conflict', a .. ':' .. b, 'overlaps'}
    end
  end
end
if base_field ~= '' and redis.call('HEXISTS', key, base_field) == 0 then return {'nobase'} end
if s > stored_end + max_gap then return {'gap', stored_end} end
local gaps = math.max(stored_end, e) - (covered + e - s)
if gaps > max_gap_total then return {'gaps', gaps} end
local n = tonumber(redis.call('HGET', key, 'n') or '0')
if n >= max_segments then return {'full', n} end
local r = s .. ':' .. e
redis.call('HSET', key, 'm', meta, 's:' .. r, value, 'd:' .. r, dig, 'h:' .. r, info)
for i = 17, #ARGV, 2 do redis.call('HSET', key, ARGV[i], ARGV[i + 1]) end
if ctx_field ~= '' then redis.call('HSET', key, ctx_field, ctx) end
redis.call('HINCRBY', key, 'b', nbytes)
if ref ~= '' then
  redis.call('HSET', key, 'r:' .. r, ref, 't:' .. r, token)
  redis.call('HINCRBY', key, 'sb', nbytes)
end
redis.call('HINCRBY', key, 'n', 1)
return refresh('stored', ref ~= '' and '1' or '0')
