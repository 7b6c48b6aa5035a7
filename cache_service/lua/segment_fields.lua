-- Meta and the names of the fields a read of rows [lo, hi) needs.
-- (Names only: copying multi-megabyte frames through Lua costs Redis ~8x the CPU of a
-- plain HMGET of the same fields, measured in bench/service_bench.py.)
-- KEYS[1]  rollout hash (or a view's)
-- ARGV     lo, hi (hi = -1: no upper bound), first_layer, last_layer (absolute layer ids
--          the read needs, -1 -1: every layer), then spans a1, b1, a2, b2, ... (the rows
--          read, within [lo, hi); none: [lo, hi) itself; b = -1: no upper bound)
-- Returns  {} when the rollout does not exist, else {meta, stored_end, field1, ...}: the
--          last stored row + 1, the overlapping s:<a>:<b> fields, every c:<digest> field,
--          and the chunk fields k:<a>:<b>:<i>:<r0>:<r1>:<l0>:<l1> of chunked segments
--          (r3_client/stored/fields.py) whose rows overlap a span and whose layer ids overlap
--          [first_layer, last_layer] (the rule of r3_client.stored.chunk_wanted)
local key = KEYS[1]
local lo, hi = tonumber(ARGV[1]), tonumber(ARGV[2])
local l_lo, l_hi = tonumber(ARGV[3] or '-1'), tonumber(ARGV[4] or '-1')
local spans = {}
for i = 5, #ARGV - 1, 2 do spans[#spans + 1] = {tonumber(ARGV[i]), tonumber(ARGV[i + 1])} end
if #spans == 0 then spans[1] = {lo, hi} end
local function overlaps(a, b, s, e)  -- [a, b) and [s, e), e = -1 unbounded
  return b > s and (e < 0 or a < e)
end
local meta = redis.call('HGET', key, 'm')
if not meta then return {} end
local out = {meta, 0}
local stored_end = 0
for _, f in ipairs(redis.call('HKEYS', key)) do
  local a, b = string.match(f, '^s:(%d+):(%d+)$')
  if a then
    a = tonumber(a); b = tonumber(b)
    if b > stored_end then stored_end = b end
    if overlaps(a, b, lo, hi) then out[#out + 1] = f end
  elseif string.sub(f, 1, 2) == 'c:' then
    out[#out + 1] = f
  else
    local sa, sb, r0, r1, f0, f1 = string.match(f, '^k:(%d+):(%d+):%d+:(%d+):(%d+):(%d+):(%d+)$')
    if sa and overlaps(tonumber(sa), tonumber(sb), lo, hi)
        and (l_lo < 0 or (tonumber(f1) >= l_lo and tonumber(f0) <= l_hi)) then
      r0 = tonumber(r0); r1 = tonumber(r1)
      for _, sp in ipairs(spans) do
        if overlaps(r0, r1, sp[1], sp[2]) then out[#out + 1] = f; break end
      end
    end
  end
end
out[2] = stored_end
return out
