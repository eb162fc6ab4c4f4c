"""mkdocs-gallery settings that ``mkdocs.yml`` cannot hold (named there as ``conf_script``;
not a page): the scripts' order in the gallery, the quickstart first and then the others by
their length in lines of code, shortest first."""

from mkdocs_gallery.sorting import NumberOfCodeLinesSortKey


class QuickstartFirst(NumberOfCodeLinesSortKey):
    def __call__(self, file):
        return (file.name != "plot_quickstart.py", super().__call__(file))


conf = {"within_subsection_order": QuickstartFirst}
