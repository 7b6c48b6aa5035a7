"""What runs in SGLang's scheduler and detokenizer processes: marking a tagged
request's rows where upstream gathers them, noting recomputes and retractions (views),
the compact hand-over to the HTTP process, and HiCache's row buffer."""
