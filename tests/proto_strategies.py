"""Hypothesis strategies for any protobuf message, read from its descriptor: every
field filled or left out at random, scalars over their whole range (unknown enum
values included), repeated fields short, nested messages to a bounded depth."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from hypothesis import strategies as st

F = FieldDescriptor
_INTS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1), F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}  # fmt: skip
# Small values are where the meaning is (token ids, counts); the whole range is tried too.
_SMALL = st.integers(0, 300)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    if field.type in _INTS:
        low, high = _INTS[field.type]
        return st.one_of(_SMALL.filter(lambda v: low <= v <= high), st.integers(low, high))
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        width = 32 if field.type == F.TYPE_FLOAT else 64
        return st.one_of(st.floats(-3, 3, width=width), st.floats(width=width))
    if field.type == F.TYPE_STRING:
        return st.text(max_size=40)
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=40)
    if field.type == F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]),
                         st.integers(-5, 50))  # fmt: skip
    raise TypeError(f"no strategy for {field.full_name}")


def messages(message_class, depth: int = 3, fixed: dict | None = None) -> st.SearchStrategy:
    """Instances of `message_class`; `fixed` fields are set as given."""
    descriptor = message_class.DESCRIPTOR

    @st.composite
    def build(draw):
        message = message_class()
        chosen_oneofs = set()
        for field in descriptor.fields:
            if fixed and field.name in fixed or not draw(st.booleans()):
                continue
            oneof = field.containing_oneof
            if oneof is not None and oneof.name in chosen_oneofs:
                continue
            if field.type == F.TYPE_MESSAGE:
                if depth == 0:
                    continue
                inner = messages(field.message_type._concrete_class, depth - 1)
                if field.message_type.GetOptions().map_entry:
                    key = field.message_type.fields_by_name["key"]
                    value = field.message_type.fields_by_name["value"]
                    entries = draw(st.dictionaries(_scalar(key), _scalar(value), max_size=5))
                    getattr(message, field.name).update(entries)
                elif field.is_repeated:
                    getattr(message, field.name).extend(draw(st.lists(inner, max_size=4)))
                else:
                    getattr(message, field.name).CopyFrom(draw(inner))
            elif field.is_repeated:
                getattr(message, field.name).extend(draw(st.lists(_scalar(field), max_size=8)))
            else:
                setattr(message, field.name, draw(_scalar(field)))
            if oneof is not None:
                chosen_oneofs.add(oneof.name)
        for name, value in (fixed or {}).items():
            setattr(message, name, value)
        return message

    return build()
